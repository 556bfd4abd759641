"""`llmserve bench kv-waste`: exact answers on hand-made traces, determinism, and the issue's targets."""

import argparse
import json

import pytest

from llmserve.bench.kv_waste import add_args, kv_waste_report, main, make_trace, markdown_table, peak_waste, replay


def test_peak_waste_by_hand():
    # 16, 17 and 1 tokens in blocks of 16: 34 tokens in 1 + 2 + 1 blocks = 64 slots.
    trace = [(15, 1), (16, 1), (0, 1)]
    assert peak_waste(trace, 16) == pytest.approx(1 - 34 / 64)
    # Contiguous reservation of 32 each: 34 tokens in 96 slots.
    assert peak_waste(trace, 32) == pytest.approx(1 - 34 / 96)
    assert peak_waste([(16, 16)], 16) == 0.0


def test_time_averaged_waste_follows_growth():
    # One request growing from 1 to 17 tokens (17 steps) in blocks of 16: tokens 1+2+...+17 = 153, slots
    # 16 for 16 steps, then 32 for one step = 288.
    stats = replay([(0, 17)], 16, 4, check=True)
    assert stats.steps == 17
    assert stats.waste_time_avg == pytest.approx(1 - 153 / 288)
    assert (stats.peak_running, stats.preemptions) == (1, 0)
    # A contiguous slot of 64 for the same request: 153 / (17 * 64).
    assert replay([(0, 17)], 64, 1).waste_time_avg == pytest.approx(1 - 153 / (17 * 64))


def test_concurrency_in_a_fixed_pool():
    trace = [(15, 1)] * 4  # 16 tokens each: one block of 16, or one contiguous slot of 32
    paged = replay(trace, 16, 64 // 16, check=True)
    assert (paged.peak_running, paged.steps, paged.waste_time_avg) == (4, 1, 0.0)
    contiguous = replay(trace, 32, 64 // 32, check=True)
    assert (contiguous.peak_running, contiguous.steps) == (2, 2)
    assert contiguous.waste_time_avg == pytest.approx(0.5)
    assert replay(trace, 16, 4, max_num_seqs=1).steps == 4


def test_preemption_by_recompute():
    # Two 3-token prompts, 3 tokens out each, in 2 blocks of 4. Step 1: both admitted (4 tokens, 1 block each).
    # Step 2: the first needs a second block, the second is preempted (it has 1 token). Step 3: the first ends.
    # Steps 4-5: the second comes back with 3 + 1 + 1 = 5 tokens (2 blocks) and ends with 6.
    stats = replay([(3, 3), (3, 3)], 4, 2, check=True)
    assert (stats.steps, stats.preemptions, stats.peak_running) == (5, 1, 2)
    assert stats.waste_time_avg == pytest.approx(1 - (8 + 5 + 6 + 5 + 6) / (8 * 5))
    assert stats.mean_running == pytest.approx(6 / 5)


def test_preemption_does_not_change_time_averaged_waste():
    # A resumed request continues from the tokens it had, so only the schedule differs between these runs.
    trace = make_trace(80, mean=300, std=100, prompt_min=16, prompt_max=64, seed=7)
    assert max(p + o for p, o in trace) <= 50 * 16  # so 8 sequences always fit 400 blocks
    thrash = replay(trace, 16, 400, max_num_seqs=256, check=True)
    calm = replay(trace, 16, 400, max_num_seqs=8, check=True)
    assert thrash.preemptions > 0 and calm.preemptions == 0
    assert thrash.peak_running > 8 == calm.peak_running
    assert thrash.waste_time_avg == pytest.approx(calm.waste_time_avg, rel=1e-12)


def test_request_larger_than_pool_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        replay([(40, 10)], 16, 3)


def test_trace_is_seeded_and_clipped():
    a = make_trace(200, seed=3)
    assert a == make_trace(200, seed=3)
    assert a != make_trace(200, seed=4)
    assert all(128 <= p <= 1024 and 1 <= o and p + o <= 8192 for p, o in a)
    wide = make_trace(2000, mean=1500, std=6000, seed=1)  # a wide spread hits both clips
    assert min(o for _, o in wide) == 1
    assert max(p + o for p, o in wide) == 8192
    assert kv_waste_report(num_requests=100, seed=5) == kv_waste_report(num_requests=100, seed=5)


def test_default_trace_meets_the_issue_targets():
    r = kv_waste_report()
    assert r["trace"]["num_requests"] == 1000
    assert 1400 < r["trace"]["mean_output_tokens"] < 1600
    assert r["paged"]["waste_at_peak"] < 0.04 and r["paged"]["waste_time_avg"] < 0.04
    assert r["contiguous"]["waste_at_peak"] > 0.60 and r["contiguous"]["waste_time_avg"] > 0.60
    # A pool of 16 max-length slots holds exactly 16 contiguous requests; paged fits several times more.
    assert r["contiguous"]["capacity_at_full_length"] == 16
    assert r["contiguous"]["replay_peak_running"] == 16
    assert r["paged"]["capacity_at_full_length"] > 3 * 16
    assert r["paged"]["replay_mean_running"] > 3 * r["contiguous"]["replay_mean_running"]
    table = markdown_table(r)
    assert "| waste with all tokens generated | 74." in table and "contiguous (max-model-len 8192)" in table


def test_cli_pair(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_args(parser)
    out = tmp_path / "kv.json"
    args = parser.parse_args(["--num-requests", "50", "--seed", "2", "--pool-tokens", "65536", "--json", str(out)])
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(kv_waste_report(num_requests=50, seed=2, pool_tokens=65536)))
    assert "| | contiguous (max-model-len 8192) | paged (block 16) |" in capsys.readouterr().out
