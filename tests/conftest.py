import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

# Without a GPU the Triton kernels run in the interpreter; it must be chosen before triton is first imported
# (transformers imports it too), and it stays on for the session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    from worker_svc.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_tokenizer(bundled_model_path):
    from transformers import AutoTokenizer

    d, f = os.path.split(bundled_model_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="session")
def hf_model(bundled_model_path):
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(bundled_model_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def runner(bundled_model_path):
    from worker_svc.runner import ModelRunner, RunnerOptions

    return ModelRunner(RunnerOptions(model=bundled_model_path, num_gpu_blocks_override=512))
