"""Exceptions raised by ``ardiff_modules``.

Every user-reachable misuse raises one of these, with a message naming the
expected and the actual value. Each also derives from the builtin exception a
caller would naturally catch (``ValueError``, ``KeyError``, ``RuntimeError``),
so code that catches those builtin exceptions keeps working.

This module is pure Python: the allocator imports it without torch.
"""

from __future__ import annotations


class ARDiffError(Exception):
    """Base class of every exception raised on purpose by this library."""


class SpecError(ARDiffError, ValueError):
    """A configuration value is invalid (names the field, expected and actual)."""


class CapacityError(ARDiffError, RuntimeError):
    """The pool has fewer free pages than an operation needs. Nothing was changed."""

    def __init__(self, message: str, *, needed: int, free: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free


class AllocatorError(ARDiffError, RuntimeError):
    """A page id or refcount operation is invalid (double free, unknown page)."""


class SessionClosedError(ARDiffError, RuntimeError):
    """An operation was attempted on a closed session."""


class SessionSuspendedError(ARDiffError, RuntimeError):
    """An operation needs a session's pages on the device, but the session is suspended to the host tier
    (``KVState.suspend``); resume it first (``KVState.resume``)."""


class SessionNotSuspendedError(ARDiffError, RuntimeError):
    """``KVState.resume`` was called on a session that is not suspended (resident, or resumed already)."""


class SessionFileError(ARDiffError, ValueError):
    """A saved-sessions file (``KVCache.load_sessions``) cannot be loaded into this cache: not a sessions file,
    truncated or corrupted, another format version, another spec (the message names the field), or a value
    out of range. Nothing was changed."""


class SessionIdClashError(ARDiffError, ValueError):
    """Sessions would be loaded (or received) under ids already open in the cache; nothing was changed."""


class SessionTransferError(ARDiffError, RuntimeError):
    """``send_sessions`` / ``recv_sessions``: the peer refused the sessions or was lost; they stayed with the
    sender (the message names the peer and its answer)."""


class TransportUnavailableError(SessionTransferError):
    """``send_sessions`` / ``recv_sessions`` with ``transport="ipc"`` (on either side): CUDA IPC cannot carry the
    sessions between these two processes (a pool not on CUDA, another machine, a GPU the receiver cannot see, a
    mapping that failed); the message names why. Nothing moved: the sessions stayed with the sender."""


class UnknownBranchError(ARDiffError, KeyError):
    """A KV branch name is not one of the spec's branches."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class UnknownCacheError(ARDiffError, KeyError):
    """A cross-attention cache name is not one of the spec's caches."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CrossAttentionNotPopulatedError(ARDiffError, RuntimeError):
    """A cross-attention cache was read before it was populated."""


class PendingContextError(ARDiffError, RuntimeError):
    """A committing forward's pending chunks were replaced before being committed."""


class SequenceLengthError(ARDiffError, ValueError):
    """``seq_len`` is not a positive multiple of ``chunk_size``."""


class StreamPositionError(ARDiffError, ValueError):
    """A forward's start position does not continue its stream (a model that passes positions itself).

    E.g. Self-Forcing's ``current_start``: neither the open chunk's start (a re-run), the next chunk's
    start, nor 0 (a new video); the message names the positions expected and the one given.
    """


class TensorMismatchError(ARDiffError, ValueError):
    """A tensor has the wrong shape, dtype or device."""


class StateDictMismatchError(ARDiffError, RuntimeError):
    """A layer's ``load_state_dict`` got missing, unexpected or mis-shaped keys; nothing was loaded.

    A ``RuntimeError``, as torch's ``load_state_dict`` raises, so callers that catch that keep working.
    """


class BackendUnavailableError(ARDiffError, RuntimeError):
    """The requested attention backend cannot run here (missing package, device, dtype)."""


class PlanNotFoundError(ARDiffError, KeyError):
    """A custom op was called with a plan handle that is not registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ForwardFinishedError(ARDiffError, RuntimeError):
    """A finished forward's contexts were used (it was committed, aborted, superseded, reset or closed).

    A forward's layer contexts may touch the pool only between ``prepare_forward`` and its
    commit / abort; any later use would overwrite committed (possibly shared or reallocated) pages.
    """


class ParticipantCommitError(ARDiffError, RuntimeError):
    """One participant of a multi-participant forward (a rank's share of a
    ``DistributedForward``) was committed alone; refused with nothing changed: commit the whole forward.

    Committing one part alone would leave the parts' histories a chunk apart for good.
    """


class CacheClosedError(ARDiffError, RuntimeError):
    """An operation was attempted on a closed :class:`KVCache`."""


class NonFiniteKVError(ARDiffError, FloatingPointError):
    """``check_finite=True``: a committing forward wrote NaN/Inf K/V; the forward was aborted instead."""


class IncompleteForwardError(ARDiffError, RuntimeError):
    """A committing forward (or re-cache) finished before every layer wrote its K/V; it was aborted instead.

    Unwritten pending pages hold whatever their previous owner left: committing them would publish
    another (possibly closed) session's K/V as this session's history.
    """


class CommitFailedError(ARDiffError, RuntimeError):
    """A commit raised an unexpected exception (chained as ``__cause__``); the forward was aborted instead."""


class KVCalibrationError(ARDiffError, ValueError):
    """FP8 calibration refused a commit: a layer's first committed K/V hold no finite nonzero value in a head.

    Calibrating from such a chunk would fix a scale that collapses every later value of that head;
    the forward was aborted. Set scales with ``KVCache.set_kv_scales`` or commit a representative chunk.
    """


class KVScalesFixedError(ARDiffError, RuntimeError):
    """FP8 K/V scales set after K/V were written with other scales (those pages would read back wrong)."""


class LatentsNotKeptError(ARDiffError, LookupError):
    """A re-cache asked for the kept clean latents of a chunk whose committing forward did not keep them."""


class InferenceOnlyError(ARDiffError, RuntimeError):
    """Backward through a path that has no gradient (e.g. a CUDA-graph replay of a forward with gradients)."""


class TrainingScopeError(ARDiffError, RuntimeError):
    """A gradient forward's history could not be read again as it was: a recomputation (activation
    checkpointing) outside :meth:`TrainingScope.checkpoint`, after the scope ended, or in another order."""


class CompileInputError(ARDiffError, TypeError):
    """A compile pitfall :class:`~ardiff_modules.CompiledStep` saw: a Python number where the compiled model
    needs a tensor, a library tensor turned into a Python number inside it, or host-side bookkeeping
    (``prepare_forward``) traced into it. Names the argument or the tensor and the fix; a dynamo error it
    stands for is chained as ``__cause__``.
    """


class CompileCacheError(ARDiffError, ValueError):
    """A compile-cache file (``load_compile_cache``) is not one ``save_compile_cache`` wrote (a directory, another
    format, an entry key that leaves torch's cache directory, an encoding the library cannot check), is truncated
    or corrupt, is not signed as ``key=`` says (unsigned, signed without a key given, another key, altered), or
    holds artifacts torch cannot read; names the file. Nothing was loaded."""


class CompileInputWarning(UserWarning):
    """:class:`~ardiff_modules.CompiledStep` recompiled after its first frame; names the likely cause."""


class UncommittedForwardsWarning(UserWarning):
    """A stream ran many forwards in a row with ``commit_current=False``: its history keeps none of them.

    Warned once per session, when one of its streams prepares more than 128 such forwards since its last
    commit (``ardiff_modules.forwards.uncommitted.UNCOMMITTED_FORWARDS_LIMIT``): usually a forgotten
    ``commit_current=True`` on the forward that finishes a chunk. Where forwards
    legitimately never commit (benchmarks, repeated re-runs of one chunk), silence it with
    ``warnings.filterwarnings("ignore", category=ardiff_modules.UncommittedForwardsWarning)``.
    """
