"""Where each data-parallel rank runs: its own GPUs, or its own CPU cores.

DATA_PARALLEL_SIZE ranks, each one vLLM engine on TENSOR_PARALLEL_SIZE GPUs: rank r gets the GPUs
r*TP .. (r+1)*TP-1 of those this process sees (CUDA_VISIBLE_DEVICES, when set, says which), so no
two engines ever share a GPU. Without GPUs each rank gets an equal, disjoint slice of the CPU cores
this process may use, pinned (sched_setaffinity and vLLM's VLLM_CPU_OMP_THREADS_BIND).

Nothing here imports torch or vLLM: the plan is made, and refused, before any model loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from batch_pipeline.base.env import read_text
from batch_pipeline.config.settings import ConfigError, EngineSettings


@dataclass(frozen=True)
class RankPlan:
    rank: int
    gpus: tuple[str, ...] = ()  # CUDA device ids as CUDA_VISIBLE_DEVICES names them
    cpus: tuple[int, ...] = ()  # CPU cores, when the rank runs on the CPU
    env: dict[str, str] = field(default_factory=dict)  # set in the rank's process before vLLM loads

    def describe(self) -> str:
        if self.gpus:
            return f"rank {self.rank}: GPU {','.join(self.gpus)}"
        return f"rank {self.rank}: CPU core {','.join(map(str, self.cpus))}"


def visible_gpus(count: int, env: dict[str, str] | None = None) -> list[str]:
    """The device ids this process may use, as CUDA_VISIBLE_DEVICES would name them to a child."""
    listed = [d.strip() for d in read_text(env, "CUDA_VISIBLE_DEVICES").split(",") if d.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def placement_problem(settings: EngineSettings, gpus: int, cpus: list[int] | None = None) -> str | None:
    """Why DATA_PARALLEL_SIZE x TENSOR_PARALLEL_SIZE does not fit this machine, or None."""
    dp, tp = settings.data_parallel_size, settings.tensor_parallel_size
    if gpus:
        if dp * tp > gpus:
            return (
                f"DATA_PARALLEL_SIZE={dp} x TENSOR_PARALLEL_SIZE={tp} needs {dp * tp} GPUs, but only {gpus} "
                "are visible here"
            )
        return None
    if dp == 1:
        return None  # one engine on the CPU uses whatever cores there are, as it always has
    cpus = usable_cpus() if cpus is None else cpus
    if dp * tp > len(cpus):
        return (
            f"DATA_PARALLEL_SIZE={dp} x TENSOR_PARALLEL_SIZE={tp} needs {dp * tp} CPU cores (one engine rank "
            f"per core at least), but this process may use {len(cpus)}"
        )
    return None


def plan_ranks(settings: EngineSettings, gpus: int, cpus: list[int] | None = None,
               env: dict[str, str] | None = None) -> list[RankPlan]:
    """One RankPlan per data-parallel rank (ConfigError when they do not fit, see placement_problem)."""
    problem = placement_problem(settings, gpus, cpus)
    if problem:
        raise ConfigError(problem)
    dp, tp = settings.data_parallel_size, settings.tensor_parallel_size
    if gpus:
        devices = visible_gpus(gpus, env)
        plans = []
        for rank in range(dp):
            mine = tuple(devices[rank * tp:(rank + 1) * tp])
            plans.append(RankPlan(rank, gpus=mine, env={"CUDA_VISIBLE_DEVICES": ",".join(mine)}))
        return plans
    cpus = usable_cpus() if cpus is None else cpus
    per_rank = len(cpus) // dp
    plans = []
    for rank in range(dp):
        mine = tuple(cpus[rank * per_rank:(rank + 1) * per_rank])
        # vLLM's CPU worker binds its OpenMP threads to these cores: one list per TP worker, "|"-separated.
        per_worker = len(mine) // tp
        lists = [",".join(map(str, mine[w * per_worker:(w + 1) * per_worker])) for w in range(tp)]
        plans.append(RankPlan(rank, cpus=mine, env={"VLLM_CPU_OMP_THREADS_BIND": "|".join(lists)}))
    return plans


def describe_plan(settings: EngineSettings, gpus: int, cpus: list[int] | None = None) -> str:
    """One line for `doctor` and the run log: ranks x TP = devices, and which device each rank has."""
    dp, tp = settings.data_parallel_size, settings.tensor_parallel_size
    try:
        plans = plan_ranks(settings, gpus, cpus)
    except ConfigError as e:
        return str(e)
    if gpus:
        head = f"{dp} rank(s) x TENSOR_PARALLEL_SIZE {tp} = {dp * tp} of {gpus} GPU(s)"
    elif dp == 1:
        return f"1 engine on the CPU ({len(usable_cpus() if cpus is None else cpus)} core(s))"
    else:
        head = f"{dp} ranks on the CPU"
    return head + "; " + "; ".join(p.describe() for p in plans)
