"""What every benchmark backend shares: the requests a workload makes and what a backend reports for each.

Times are seconds from the start of the run (one `time.perf_counter()` origin per run), so results from the
llmserve gRPC client and the in-process Hugging Face baselines compare directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int  # fixed output length: requests are sent with ignore_eos, so every backend makes exactly this
    arrival_s: float  # offset from the start of the run at which the client sends it
    cancel_after_tokens: int | None = None  # the `cancel` workload: the client gives up after this many tokens


@dataclass
class RequestResult:
    request_id: str
    prompt_tokens: int
    arrival_s: float  # when it was due (RequestSpec.arrival_s)
    sent_s: float | None = None  # when the client sent it (>= arrival_s only under --max-concurrency); TTFT and
    # end-to-end latency count from here, so time queued inside the serving system counts
    started_s: float | None = None  # in-process baselines: when the backend began work on it (after its queue)
    token_times: list[float] = field(default_factory=list)  # arrival of each output token (a chunk shares one time)
    end_s: float | None = None
    output_ids: list[int] = field(default_factory=list)
    ok: bool = False  # finished normally (or was cancelled on purpose by the `cancel` workload)
    cancelled: bool = False
    error: str = ""  # gRPC status name and message, or the exception, when not ok

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)
