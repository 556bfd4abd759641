"""One tensor-parallel rank's part of a quantized weight (quant.QuantizedWeight, [out, in] codes with per-row
scales over groups of input columns), cut where sharding.param_slice cuts the dense weight.

Column-parallel weights (q/k/v, gate/up) lose output rows: codes, scales and zeros are all per row, so any cut is
exact (a 128x128 FP8 block's scale is already repeated on each of its rows). Row-parallel ones (o, down) lose input
columns, and a group's scale covers several: a rank's columns must be whole groups (the int4 / int8 kernels'
32-column groups, or an FP8 checkpoint's `weight_block_size` width), else the cut is refused naming the limit, as
vLLM refuses it. Pure tensor slicing, no collectives.
"""

from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig
from worker_svc.model.quant import QuantizedWeight
from worker_svc.parallel.sharding import Shard, param_slice


def shard_quantized(name: str, weight: QuantizedWeight, cfg: ModelConfig, shard: Shard) -> QuantizedWeight:
    """This rank's rows (column-parallel) or columns (row-parallel) of `weight`, in memory of its own."""
    s = param_slice(name, cfg, shard)
    if s is None:
        return weight
    dim, start, stop = s
    if dim == 0:  # a clone: a row slice is contiguous already, and as a view it would keep the whole weight alive
        return weight.map_rows(lambda t: t[start:stop].clone())
    inp = weight.shape[1]
    if weight.is_fp8 and weight.group >= inp:  # one scale per row (per tensor or per channel): any columns
        return dataclasses.replace(weight, codes=weight.codes[:, start:stop].contiguous(), group=stop - start)
    group = weight.group
    if start % group or (stop % group and stop != inp):
        limit = (f"quantization_config.weight_block_size's {group} columns" if weight.is_fp8
                 else f"the {group}-column groups of the int{weight.bits} kernels")
        raise ValueError(f"--tensor-parallel-size {shard.size}: {name} gives each rank {stop - start} of its {inp} "
                         f"input columns, which is not a whole number of {limit}")

    def columns(t):
        return None if t is None else t[:, start // group:-(-stop // group)].contiguous()

    return dataclasses.replace(weight, codes=weight.codes[:, start:stop].contiguous(), scale=columns(weight.scale),
                               zero=columns(weight.zero))
