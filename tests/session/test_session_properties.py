"""Stateful property test of the session API (``KVCache`` / ``KVState``) against a plain model.

A tiny CPU float32 pool (2 layers, 1 KV head, head_dim 2, chunk_size 2 or 4, page size
1 or 2, sinks 0..2, window 0..3 or unbounded, branches ``("cond", "uncond")``, one
cross cache ``"text"`` of 3 tokens) just big enough that capacity errors happen.

Chunks have **variable lengths**: a forward's pending chunks may each hold any positive
multiple of the page size up to ``chunk_size`` tokens (an image-to-video first chunk of one
latent frame, then full chunks; or mixed patterns such as ``(1, 4, 2)``), passed as
``chunk_lengths=(...)`` or, for one shorter chunk or full chunks only, by ``seq_len`` alone.
Every stream of a forward has the same lengths; different forwards of a branch (a denoising
loop re-prepared with other lengths, later chunks) may differ.
Up to two ``KVCache`` instances live side by side (each with its own pool,
``contiguous_extents``, ``max_forward_contexts`` of 1, 2, 3 or 64, ``check_finite``);
either may be closed at any point and a new one opened.

The machine (``tests/support/session_machine/``, one module per subject) and its model
(``tests/support/session_model.py``):

Model
-----
* per session and branch: every chunk ever committed as a :class:`ChunkRecord` (the page
  tuple the library reported, its token count -- the length the model asked for --, its
  absolute start position -- the model's running sum of committed tokens --, and the pool
  contents it was committed with), the pending chunks with the token count of each, the
  open forward it belongs to, the extent, the cross cache contents;
* per forward: one :class:`TxModel` for the whole transaction (all its streams, of up
  to three sessions), with status open / committed / completed (a denoising forward that
  finished) / aborted / superseded, mirroring
  ``ForwardTransaction``. Finishing any member (``commit_paged_context``, ``abort``,
  ``ctx.commit()/abort()``, the ``with`` exit, ``reset``/``close`` of a member session,
  ``KVCache.close``) finishes every stream of it, or none;
* per cache: the forward-context registry (an LRU ``OrderedDict``: same streams ->
  same reused ``ForwardContext``; beyond ``max_forward_contexts`` the least recently
  used idle one is released), the peak of pages used, and :class:`PoolContents`: what
  every page of the pool must hold. Forwards write K/V carrying a unique id per
  (forward, stream, token, layer), and the model applies each write to the pages it
  says the forward owns (its pending pages, in token order).

Checked after every step
------------------------
* each page's refcount == the references the model counts (visible + pending chunks of
  every open session, extent reservations); pending pages are exclusive; free and used
  pages partition the pool; ``peak_pages_used`` == the model's peak;
* visible history == first S + last W of the committed list (list slicing: sinks and
  windows count chunks, whatever their lengths); ``token_offset`` / ``committed_tokens`` ==
  the tokens the model committed; each visible chunk's ``(start, tokens)`` span and every
  history position; each pending chunk's length; ``open_forward()`` is the model's
  transaction (identity, members, commit flag, chunks);
* every open forward, as its attention sees it: ``positions``, ``key_positions()`` (the
  model's position of every visible key, ``-1`` padding), ``to_dense()`` (history visible,
  block-causal over the model's pending chunk lengths -- or every pending key under the
  ``pending_attention="bidirectional"`` rule, said per forward or by the spec's default --
  ANDed with the token mask), and the
  dense K/V the reference backend gathers for it, per layer, bit for bit == what the model
  says each resident chunk held when committed, position by position, then what this
  forward wrote into its pending chunks;
* the pool, bit for bit, == the model's contents: no write ever lands outside the
  pending pages of an open forward; every visible committed chunk still holds what it
  held when committed (shared/forked pages included) until its pages are freed;
* the context registry (identity and LRU order), each context's ``released`` /
  ``is_active`` and transaction, every tracked transaction's status.

Rules (besides sessions, cross caches, forks and sink sharing): forwards over 1-3 sessions
(denoising or committing, of 1-3 chunks of mixed lengths, ``token_mask``, run through the op
or ``ChunkSelfAttention``, finished
through any member or left open); ``with`` blocks that raise (``Exception``, a custom
``BaseException``, ``KeyboardInterrupt``) or finish the forward inside and keep running; stale
contexts (committed, completed, aborted, superseded, released by the LRU / ``close``); exceptions
injected into a commit or abort (``BranchPages.preview_commit`` on the 2nd stream,
``PageAllocator.decref``) and a real SIGINT while a commit is applied; a user retention policy
breaking its contract at a commit (``tests/support/policies.py``: bad types, unsorted, duplicates, an evicted
chunk brought back, more than declared, ...: ``SpecError``, nothing changed); NaN/Inf K/V under
``check_finite``; ``plan()`` raising; prompt-switch re-caches (``prepare_recache`` over 1-3 sessions,
``keep_sinks`` either way: positions, key positions, mask, gathered K/V and write-protected sinks checked,
then committed -- records swapped for the rebuilt pages, those in fresh pages copied into ring slots the
commit frees -- or aborted with free order and sessions unchanged,
or refused unchanged); ``begin_shot`` (then the shot's chunks) and ``drop_window`` under a spec that pins a
shot sink (``ShotSinkPolicy``: visible history == sinks + pinned shot chunks + the newest filling the window, no
non-sink chunk below a dropped window), refused unchanged with an open forward, closed, or a policy without shots;
admission; ``KVCache.close()``; misuse across two caches;
rollouts whose first chunk is short (image-to-video) or whose chunks vary; invalid
``chunk_lengths`` (wrong sum, off the page grid, above ``chunk_size``, empty).

Failing operations (misuse, capacity, closed session/cache, a foreign cache's session,
a ``plan()`` that raises, a stale context, an exception injected into a commit, a misbehaving policy) must
change nothing: allocator free order and refcounts, peak, pool contents, context
registry, every transaction and every session are snapshotted before and compared after.
Closing every session (and cache) at the end must free every page.

The same machine over an FP8 pool: ``tests/fp8/test_fp8_session_properties.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from tests.support.session_machine import SessionStateMachine

TestSessionStateMachine = pytest.mark.slow(SessionStateMachine.TestCase)
# More and longer runs than the profile's default: this machine is the main leak/consistency net.
TestSessionStateMachine.settings = settings(
    max_examples=settings.default.max_examples * 3 // 2,
    stateful_step_count=settings.default.stateful_step_count * 2,
)
