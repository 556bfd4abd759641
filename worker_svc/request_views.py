"""One request at a time: list-like views of a request's row in the persistent batch.

The step works on whole columns; these are for code that wants a request as an object (the fake worker of the
scheduler tests, benchmarks, debugging). They read and write through to the arrays, so they stay valid only while
the request keeps its row.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from worker_svc.input_batch import InputBatch
from worker_svc.sampling import SamplingParams


class TokenIds:
    """A row's prompt + output tokens as a list-like view: len, indexing, iteration, append, `del ids[n:]`."""

    def __init__(self, inputs: InputBatch, row: int):
        self._inputs, self._row = inputs, row

    def _array(self) -> np.ndarray:
        return self._inputs.token_ids[self._row, : self._inputs.num_tokens[self._row]]

    def __len__(self) -> int:
        return int(self._inputs.num_tokens[self._row])

    def __getitem__(self, i: int | slice) -> int | list[int]:
        return self._array()[i].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self._array().tolist())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence | TokenIds) else NotImplemented

    def append(self, token: int) -> None:
        self._inputs.append_tokens(np.array([self._row]), np.array([token]))

    def __delitem__(self, key: slice) -> None:
        start, stop, step = key.indices(len(self))
        if stop != len(self) or step != 1:
            raise ValueError("only a tail (del ids[n:]) can be deleted")
        self._inputs.num_tokens[self._row] = start


class RequestState:
    """One request's row, read and written through; valid while the request is in the batch."""

    __slots__ = ("_inputs", "row")

    def __init__(self, inputs: InputBatch, row: int):
        self._inputs, self.row = inputs, row

    @property
    def request_id(self) -> str:
        return self._inputs.request_ids[self.row]

    @property
    def token_ids(self) -> TokenIds:  # prompt + output so far
        return TokenIds(self._inputs, self.row)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self._inputs.num_prompt_tokens[self.row])

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def sampling(self) -> SamplingParams:
        return self._inputs.params[self.row]

    @property
    def block_ids(self) -> list[int]:
        return self._inputs.block_table[self.row, : self._inputs.num_blocks[self.row]].tolist()

    @property
    def num_computed_tokens(self) -> int:
        return int(self._inputs.num_computed_tokens[self.row])

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        self._inputs.num_computed_tokens[self.row] = n


class Requests(Mapping[str, RequestState]):
    """The batch's requests by id; `del requests[rid]` frees the request's row."""

    def __init__(self, inputs: InputBatch):
        self._inputs = inputs

    def __getitem__(self, request_id: str) -> RequestState:
        return RequestState(self._inputs, self._inputs.row_of[request_id])

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._inputs.row_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._inputs.row_of)

    def __len__(self) -> int:
        return len(self._inputs.row_of)

    def __delitem__(self, request_id: str) -> None:
        self._inputs.free(self._inputs.row_of[request_id])


@dataclass
class ScheduledChunk:
    """One request's share of a step: compute token_ids[start:start + length]."""

    state: RequestState
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == len(self.state.token_ids)
