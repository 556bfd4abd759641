"""lm-eval (`local-completions`) against a real llmserve stack scores a local multiple-choice task exactly as
lm-eval's Hugging Face backend does on the same weights (float32): the loglikelihood requests it sends are
completions with echo, logprobs 1 and max_tokens 1, which need every prompt token's logprob.

The weights: the bundled GGUF, dequantized by transformers and saved as an HF checkpoint, which both backends load.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.support import cluster
from tests.support.hf_reference import save_hf_checkpoint
from tests.support.stack import Stack

TASK = "llmserve_mc"
ITEMS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which planet is known as the red planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
    ("What is two plus two?", ["three", "five", "four", "six"], 2),
    ("Which animal barks?", ["dog", "cat", "cow", "fish"], 0),
    ("What color is the sky on a clear day?", ["green", "blue", "red", "yellow"], 1),
    ("Water freezes at what temperature in Celsius?", ["100 degrees", "50 degrees", "0 degrees", "10 degrees"], 2),
    ("Which is the largest ocean?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("What do bees make?", ["milk", "honey", "silk", "wool"], 1),
    ("How many days are in a week?", ["five", "six", "seven", "eight"], 2),
    ("What is the opposite of hot?", ["cold", "warm", "big", "fast"], 0),
    ("Which language is spoken in Spain?", ["French", "German", "Spanish", "Italian"], 2),
    ("What gas do plants absorb from the air?", ["oxygen", "carbon dioxide", "helium", "nitrogen"], 1),
    ("Which month comes after January?", ["March", "December", "February", "April"], 2),
    ("What is the chemical symbol for gold?", ["Ag", "Au", "Fe", "Pb"], 1),
    ("How many hours are in a day?", ["twelve", "twenty-four", "thirty", "sixty"], 1),
    ("Which fruit is yellow and curved?", ["apple", "grape", "banana", "cherry"], 2),
    ("What is the boiling point of water in Celsius?", ["100 degrees", "0 degrees", "50 degrees", "200 degrees"], 0),
    ("Who wrote Romeo and Juliet?", ["Charles Dickens", "William Shakespeare", "Mark Twain", "Jane Austen"], 1),
    ("Which shape has three sides?", ["square", "circle", "triangle", "hexagon"], 2),
]
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, hf_model, hf_tokenizer):
    d = tmp_path_factory.mktemp("lm-eval")
    model_dir = d / "smollm2-hf"
    save_hf_checkpoint(hf_model, model_dir)
    hf_tokenizer.save_pretrained(model_dir)
    task_dir = d / "tasks"
    task_dir.mkdir()
    data = task_dir / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
    (task_dir / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return d


def lm_eval(workdir, name: str, model: str, model_args: str, *extra: str) -> tuple[dict, list[dict]]:
    """Run the lm-eval CLI; its aggregate results and its per-document samples."""
    out = workdir / f"out-{name}"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OPENAI_API_KEY": "unused"}
    cmd = [os.path.join(os.path.dirname(sys.executable), "lm_eval"), "run", "--model", model,
           "--model_args", model_args, "--tasks", TASK, "--include_path", str(workdir / "tasks"),
           "--output_path", str(out), "--log_samples", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(open(glob.glob(f"{out}/**/results_*.json", recursive=True)[0]).read())
    samples = [json.loads(line) for line in open(glob.glob(f"{out}/**/samples_{TASK}_*.jsonl", recursive=True)[0])]
    return results["results"][TASK], sorted(samples, key=lambda s: s["doc_id"])


# slow: lm-eval's CLI twice (its HF backend too) over a whole stack; the property it leans on, every prompt token's
# logprob through completions with echo equal to HF's, is checked in the default run by
# tests/e2e/test_prompt_scoring_api.py::test_echo_logprobs_match_hf.
@pytest.mark.slow
def test_local_completions_scores_like_hf(workdir):
    model_dir = workdir / "smollm2-hf"
    with Stack(["--model", str(model_dir), "--dtype", "float32", "--num-gpu-blocks-override", "256",
                "--max-model-len", "1024"], ["--max-num-seqs", "8"]) as stack:
        api = cluster.start_api(stack.address)
        try:
            url = f"http://127.0.0.1:{api.port}"
            deadline = time.monotonic() + 60
            while httpx.get(url + "/health").status_code != 200:
                assert time.monotonic() < deadline, api.log_tail()
                time.sleep(0.2)
            name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            served, served_samples = lm_eval(
                workdir, "llmserve", "local-completions",
                f"base_url={url}/v1/completions,model={name},tokenizer={model_dir},tokenizer_backend=huggingface,"
                "num_concurrent=4,max_retries=1,tokenized_requests=True")
        finally:
            cluster.stop(api)
        assert stack.driver.core.pool.num_used == 0, "every request's KV freed"
    hf, hf_samples = lm_eval(workdir, "hf", "hf", f"pretrained={model_dir},dtype=float32", "--device", "cpu",
                             "--batch_size", "8")
    assert served["acc,none"] == hf["acc,none"] and served["acc_norm,none"] == hf["acc_norm,none"]
    assert served["acc,none"] > 0.25 + 1e-9 or hf["acc,none"] <= 0.25, "scores above chance when HF's do"
    assert len(served_samples) == len(hf_samples) == len(ITEMS)
    for a, b in zip(served_samples, hf_samples, strict=True):
        got = [float(r[0][0]) for r in a["resps"]]
        want = [float(r[0][0]) for r in b["resps"]]
        assert got == pytest.approx(want, abs=1e-3), a["doc_id"]
        assert [bool(r[0][1]) for r in a["resps"]] == [bool(r[0][1]) for r in b["resps"]], a["doc_id"]
