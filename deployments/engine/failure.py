"""Why an engine could not start, in the engine's own words: the line vLLM wrote for the root cause (not the wrapper
its front end raises, "Engine core initialization failed. See root cause above"), what kind of failure it is, the
YAML key that fixes it, and whether another attempt could go otherwise.

The root cause of a failure inside vLLM's engine core or its workers is in their output, not in the exception the
replica sees: those processes write to the replica's own stdout and stderr (Ray's `worker-*.out` / `.err` files), so
the replica reads what was written there since the start began (`OutputMark`). The failure travels as one line of
JSON after MARKER in the exception's message, which Serve keeps in its status: the control plane (`summit
wait-ready`, `summit serve-local`, the SLURM job) reads it back with `StartFailure.from_text`.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass

MARKER = "summit-start-failure"
_READ_AT_MOST = 1 << 20  # bytes of a replica's output read for the root cause (the tail, if more was written)

# vLLM's wrappers around a failure in another process: never the root cause themselves
_WRAPPERS = (
    "Engine core initialization failed",
    "initialization failed due to an exception in a background process",
    "See root cause above",
    "EngineDeadError",
)
# what a worker writes when the process above it died: never the root cause
_CONSEQUENCES = {"BrokenPipeError", "ConnectionResetError", "EOFError"}
# "(EngineCore pid=12) ERROR 12-07 05:16:25 [core.py:1510] " (vLLM's log prefix), "(ServeReplica:a:b pid=9) " (Ray's)
_PREFIX = re.compile(
    r"^(?:\x1b\[[0-9;]*m)*(?:\([^)]*pid=\d+\)(?:\x1b\[[0-9;]*m)*\s*)*(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\] )?"
)
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit|Interrupt))(?:\([^)]*\))?: (.+)$")
_CORE_EXIT = re.compile(r"'(\w+)': (-?\d+)")
_SIGNAL_CODE = re.compile(r"'\w+': -\d+")  # an exit code vLLM read: negative, a signal

# kind: (what a line of the root cause holds, the fix, whether another attempt could succeed)
_KINDS = (
    (
        "gpu_memory",
        ("CUDA out of memory", "OutOfMemoryError", "CUDA error: out of memory"),
        "the model does not fit its GPUs: raise tensor_parallel_size (or pipeline_parallel_size), quantize "
        "(engine_kwargs.quantization: fp8), or lower engine_kwargs.max_num_seqs / gpu_memory_utilization; check that "
        "no other process holds GPU memory (nvidia-smi). `summit validate --gpu ...` sizes it",
        False,
    ),
    (
        "weights",
        (
            "No such file or directory",
            "Repo id must be",
            "does not appear to have a file named",
            "Can't load the configuration",
            "is not a valid JSON file",
            "Permission denied",
            "is not a local folder",
            "Incorrect path_or_model_id",
        ),
        "models[].source must be a checkpoint directory (with a readable config.json and weights) at the same path "
        "on every node that runs the model",
        False,
    ),
    (
        "architecture",
        ("are not supported for now", "Model architectures"),
        "the installed vLLM does not serve this model's architecture (config.json `architectures`): serve a model "
        "it supports, or install a vLLM that does (`summit validate` reads vLLM's own registry)",
        False,
    ),
    (
        "quantization",
        ("quantization",),
        "models[].engine_kwargs.quantization, or the checkpoint's own quantization_config, names a method the "
        "installed vLLM refuses; a deprecated one (fbgemm_fp8, Meta's FP8 checkpoints) needs "
        "engine_kwargs.allow_deprecated_quantization: true",
        False,
    ),
    (
        "kv_cache",
        ("KV cache is needed", "larger than the available KV cache memory", "No available memory for the cache"),
        "one sequence of engine_kwargs.max_model_len does not fit the KV cache: lower max_model_len, or give the KV "
        "cache more memory (engine_kwargs.gpu_memory_utilization on GPUs; kv_cache_memory_bytes on CPUs). "
        "`summit validate` sizes it",
        False,
    ),
    (
        "max_model_len",
        ("is greater than the derived max_model_len",),
        "engine_kwargs.max_model_len is longer than the model's context (config.json max_position_embeddings): "
        "lower it",
        False,
    ),
    (
        "vllm_version",
        ("outside the versions Summit supports",),
        "install a vLLM in the supported range (docs/getting-started/install.md)",
        False,
    ),
)
_KILLED_FIX = (
    "the engine process was killed while it started; on a cluster node that is most often the kernel's "
    "out-of-memory killer (host memory, not GPU memory: `dmesg` or the node's syslog says so). Give the job more "
    "memory (`summit sbatch --mem`, docs/operations/troubleshooting.md)"
)
_OTHER_FIX = "see the replica's log for the engine's output"


@dataclass(frozen=True)
class StartFailure:
    """One replica's failed engine start, as the control plane reports it."""

    model: str
    kind: str  # weights | architecture | quantization | kv_cache | max_model_len | gpu_memory | killed | ...
    reason: str  # the root cause, as the engine wrote it (one line)
    fix: str
    retry: bool  # another attempt could succeed (a killed process); a config error fails the same way again
    log: str | None = None  # where the replica's output is: "NODE:PATH"
    began: float | None = None  # when the replica began this start (epoch s): a record older than a redeploy is stale

    def message(self) -> str:
        """The exception's message: a sentence, then the record (one JSON line after MARKER)."""
        return (
            f"model {self.model!r}: its engine could not start: {self.reason}\nFix: {self.fix}"
            + (f"\nThe replica's log: {self.log}" if self.log else "")
            + f"\n{MARKER} {json.dumps(asdict(self))}"
        )

    @classmethod
    def from_text(cls, text: str | None) -> StartFailure | None:
        """The last record in `text` (Serve's status message, a log), or None."""
        found = None
        for match in re.finditer(re.escape(MARKER) + r" (\{.*?\})\s*$", text or "", re.MULTILINE):
            try:
                found = cls(**json.loads(match.group(1)))
            except (TypeError, ValueError):
                continue
        return found


class EngineStartFailed(RuntimeError):
    """A replica's engine could not start; the message carries the StartFailure record."""

    def __init__(self, failure: StartFailure):
        super().__init__(failure.message())
        self.failure = failure


class OutputMark:
    """Where this process's stdout and stderr files stood when the engine's start began: vLLM's engine core and its
    workers inherit them (Ray's worker log files), so what they wrote since is read back from here. Not files (a
    terminal, a pipe): nothing is read."""

    def __init__(self):
        self.files: list[tuple[str, int]] = []
        for fd in (1, 2):
            try:
                path = os.path.realpath(f"/proc/self/fd/{fd}")
                if os.path.isfile(path):
                    self.files.append((path, os.path.getsize(path)))
            except OSError:
                continue

    def lines(self) -> list[str]:
        """The lines written since the mark, stdout's then stderr's, prefixes (vLLM's, Ray's) removed."""
        out = []
        for path, start in self.files:
            try:
                with open(path, "rb") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(max(start, size - _READ_AT_MOST))
                    text = f.read().decode(errors="replace")
            except OSError:
                continue
            out += [_PREFIX.sub("", line).rstrip() for line in text.splitlines()]
        return out

    @property
    def where(self) -> str | None:
        """The log files, for the message ("...worker-ID.out, ...worker-ID.err")."""
        return ", ".join(path for path, _ in self.files) or None


def start_failure(model: str, error: BaseException, output, log: str | None = None) -> StartFailure:
    """What `error` (raised by the engine's start) says, with the root cause from `output()` (the lines the engine's
    processes wrote meanwhile, `OutputMark.lines`) where vLLM's exception only wraps it: read again for up to 3 s
    while it holds no error, since a failing process writes its traceback to stderr as it exits."""
    if isinstance(error, EngineStartFailed):
        return error.failure
    said = _exception_line(error)
    root = said
    if any(w in said for w in _WRAPPERS):
        lines = output()
        deadline = time.monotonic() + 3
        while not _first_exception(lines) and time.monotonic() < deadline:
            time.sleep(0.2)
            lines = output()
        output = lines
        # a process killed by a signal wrote no traceback: what its siblings wrote after (a BrokenPipeError) follows
        # from its death, so a signal vLLM saw is the root cause unless a worker ran out of GPU memory; where vLLM saw
        # no exit code ("{}"), an error the process wrote comes first
        signalled = _killed(str(error))
        root = _priority_line(output) or (None if _SIGNAL_CODE.search(str(error)) else _first_exception(output))
        if root is None and signalled:
            return StartFailure(model, "killed", signalled, _KILLED_FIX, True, log)
        root = root or said
    for kind, needles, fix, retry in _KINDS:
        if any(n in root for n in needles):
            return StartFailure(model, kind, root, fix, retry, log)
    return StartFailure(model, "other", root, _OTHER_FIX, True, log)


def _exception_line(error: BaseException) -> str:
    """`Type: message` of the innermost cause, on one line; a pydantic error's "Value error, ..." line."""
    while error.__cause__ is not None and not str(error):
        error = error.__cause__
    text = str(error)
    for line in text.splitlines():
        if "Value error, " in line:
            text = line.split("Value error, ", 1)[1]
            break
    text = re.sub(r" \[type=value_error.*$", "", text.strip().splitlines()[0] if text.strip() else "")
    text = _untuple(text)
    return f"{type(error).__name__}: {_shorten(text)}"


def _untuple(text: str) -> str:
    """vLLM 0.26–0.34 raise one refusal as ValueError(format, argument): its str is a tuple's repr; format it."""
    match = re.fullmatch(r"\('(.*%s.*)', '([^']*)'\)", text)
    return match.group(1).replace("%s", match.group(2), 1) if match else text


def _shorten(text: str, limit: int = 600) -> str:
    """A long line cut (vLLM lists every architecture it supports in one)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _killed(message: str) -> str | None:
    """vLLM's "Failed core proc(s): {'EngineCore': -9}": a process ended by a signal, said in words. An empty
    "{}" (vLLM saw the process gone before its exit code) is a death without a traceback of its own: a signal too."""
    import signal

    codes = _CORE_EXIT.findall(message)
    for name, code in codes:
        if int(code) < 0:
            try:
                sig = signal.Signals(-int(code)).name
            except ValueError:
                sig = f"signal {-int(code)}"
            return f"vLLM's engine process ({name}) was ended by {sig} while the engine started"
    if not codes and "Failed core proc(s): {}" in message:  # vLLM saw it gone before its exit code
        return "vLLM's engine process (EngineCore) was ended by a signal while the engine started"
    return None


def _priority_line(lines: list[str]) -> str | None:
    """A line that is the root cause wherever it stands (CUDA out of memory in any worker)."""
    for line in lines:
        if any(n in line for n in _KINDS[0][1]) and _EXCEPTION.match(line):
            return _shorten(line)
    return None


def _first_exception(lines: list[str]) -> str | None:
    """The first `Type: message` line of a traceback that is not one of vLLM's wrappers (the first failure: later ones,
    a worker's BrokenPipeError after its parent died, follow from it)."""
    for line in lines:
        match = _EXCEPTION.match(line.strip())
        if match and not any(w in line for w in _WRAPPERS) and match.group(1) not in _CONSEQUENCES:
            return _shorten(f"{match.group(1)}: {_untuple(match.group(2))}")
    return None
