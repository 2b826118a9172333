"""Process flags of the entry points and `jax.distributed` start-up for multi-process runs.

One process per host (Cloud TPU pod slices, several GPU hosts) or several
per machine (CPU tests). Every process runs the same command; JAX then sees
all processes' devices as one set, the mesh spans them, and each process
loads only its share of every batch (the data-source contract).

  --multiprocess      start JAX's distributed runtime with every setting
                      detected (Cloud TPU pod slices, Slurm, Open MPI) or
                      read from JAX_COORDINATOR_ADDRESS;
  --coordinator_address=HOST:PORT --num_processes=P --process_id=I
                      explicit settings (several GPU hosts, local tests);
                      any of them implies --multiprocess.

Must run before anything touches a JAX backend: device lists and
collectives are fixed when the backends start.
"""

from __future__ import annotations

import dataclasses

import jax
from absl import flags, logging

from jrope.errors import UsageError


@dataclasses.dataclass(frozen=True)
class ProcessFlags:
    """Flag holders returned by `define_flags` (read after absl has parsed argv)."""

    multiprocess: flags.FlagHolder
    coordinator_address: flags.FlagHolder
    num_processes: flags.FlagHolder
    process_id: flags.FlagHolder


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> ProcessFlags:
    """Define the process flags (once per program, in the entry point)."""
    return ProcessFlags(
        multiprocess=flags.DEFINE_bool(
            "multiprocess",
            False,
            "Start JAX's distributed runtime, detecting the cluster (Cloud TPU, Slurm, Open MPI).",
            flag_values=flag_values,
        ),
        coordinator_address=flags.DEFINE_string(
            "coordinator_address",
            None,
            "HOST:PORT of process 0's coordinator service (reachable from every process).",
            flag_values=flag_values,
        ),
        num_processes=flags.DEFINE_integer(
            "num_processes",
            None,
            "Number of processes of the run.",
            lower_bound=1,
            flag_values=flag_values,
        ),
        process_id=flags.DEFINE_integer(
            "process_id",
            None,
            "This process's index, 0 .. num_processes - 1.",
            lower_bound=0,
            flag_values=flag_values,
        ),
    )


def initialize_from_flags(process_flags: ProcessFlags) -> None:
    """Start the distributed runtime when the flags ask for it, then log this process's devices.

    Single-process runs only log.
    """
    explicit = {
        "coordinator_address": process_flags.coordinator_address.value,
        "num_processes": process_flags.num_processes.value,
        "process_id": process_flags.process_id.value,
    }
    if process_flags.multiprocess.value or any(value is not None for value in explicit.values()):
        initialize(**explicit)
    logging.info(
        "JAX process %d of %d; local devices %s; all devices %d.",
        jax.process_index(),
        jax.process_count(),
        jax.local_devices(),
        jax.device_count(),
    )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """`jax.distributed.initialize` with CPU collectives enabled.

    Unset arguments are detected by JAX (Cloud TPU metadata, Slurm, Open
    MPI, JAX_COORDINATOR_ADDRESS). On CPU, cross-process collectives need an
    implementation; gloo ships with jaxlib. Accelerator backends ignore it.
    """
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise UsageError(
            f"--process_id={process_id} must lie in [0, --num_processes={num_processes}); "
            "number the processes 0 .. num_processes - 1."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    logging.info(
        "Distributed runtime up: process %d of %d, %d local and %d global devices.",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
