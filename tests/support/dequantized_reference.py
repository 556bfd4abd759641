"""The check every quantized-checkpoint test makes: our model on the quantized weights against transformers on the
dequantized ones, logits within a tolerance and greedy tokens equal while the reference's choice is clear."""
from __future__ import annotations

import torch

from tests.service.test_model import PagedRunner
from tests.service.test_model_families import prompts

LOGIT_TOL = 1e-3  # float32 on both sides: they differ by summation order only
MARGIN = 1e-2  # a top-2 gap at or below this is a near tie, past which the two paths may part
STEPS = 8


def assert_matches_dequantized(hf, ours) -> None:
    for prompt in prompts(hf.config.vocab_size, lengths=(40, 23)):
        runner = PagedRunner(ours, 64)
        got = runner.step({0: prompt}, all_logits=True)
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        assert (got - want).abs().max().item() < LOGIT_TOL
        ids = list(prompt)
        for _ in range(STEPS):
            with torch.no_grad():
                ref = hf(torch.tensor([ids])).logits[0, -1]
            top2 = ref.topk(2).values
            if top2[0] - top2[1] <= MARGIN:
                break
            token = int(got[-1].argmax())
            assert token == int(ref.argmax()), (prompt, ids[len(prompt):])
            ids.append(token)
            got = runner.step({0: [token]})
