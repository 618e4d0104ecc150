#!/usr/bin/env bash
# The GPU session's batches: each step logged to $OUT/<step>.log, results written under $OUT.
#   bash .gpu/run.sh bash benchmarks/run_h200.sh tests attention sessions     (device run 1)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh end_to_end example           (device run 2)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh end_to_end_fa3              (issue 28; limit 300 s, ~3 min est.)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh end_to_end_four_forwards    (issue 28; limit 450 s, ~5 min est.)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh end_to_end_fa3_compiled     (issue 28; limits 290 + 280 s)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh peers_cfg_off               (issue 42; limit 560 s; peers_cfg_on likewise)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh forcingkv_peers_cfg_off     (issue 42; limit 560 s; _cfg_on likewise)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh dynamic_cfg_off             (issue 42; limit 560 s; est. 8-10 min for all
#        four rows, likely cut: the partial JSON keeps the rows done; dynamic_cfg_on likewise; dynamic_pair_cfg_off:
#        the same-method pair alone, est. 4-6 min, the Forcing-KV peer's compile never measured on a GPU)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh serving serving_14b         (host tier; limits 300 + 200 s, ~2 + ~1 min est.)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh session_files               (issue 45; limit 300 s, ~3 min est.)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh training_modes              (issue 43; limit 560 s, ~4 min est.)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh serving_compiled_cfg_off    (issue 45; limit 560 s, ~5 min est.)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh session_transport           (issue 45; limit 240 s, ~1-2 min est.)
#   (one device command each: a command may run 600 s at most)
#   bash .gpu/run.sh bash benchmarks/run_h200.sh tests_multi_gpu multi_gpu    (kind nvidia-h200-x2)
# A step that fails or overruns its time limit is reported and the next one still runs. Results keep the
# scripts' plain names under $OUT (attention.json, ...); committed, they become benchmarks/results/<name>_<device>.*
# (benchmarks/README.md, "Results").
# The device gets a copy of the tree without .git: pass the commit for the JSON's run metadata, e.g.
#   ARDIFF_BENCH_GIT=$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty) bash .gpu/run.sh bash ...
set -u
cd "$(dirname "$0")/.." || exit 2  # the repository root: python -m benchmarks.X and the tests' paths need it
out=${OUT:-/tmp/ardiff-out}
# Forcing-KV's published Self-Forcing head file (vendored, unmodified) for every --heads forcingkv step; until stop 56
# they ran a fixed-seed map with its per-layer static counts (the JSON's heads_source says which).
FORCINGKV_HEADS=${FORCINGKV_HEADS:-tests/data/forcing_kv/configs_head/forcingkv_heads_selfforcing.json}
mkdir -p "$out"
status=0
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
}
fa3_compiled() {  # end_to_end_fa3_compiled for one CFG setting ($1: on / off) within $2 seconds
  step "end_to_end_fa3_compiled_cfg_$1" "$2" python3 -m benchmarks.end_to_end --cfg "$1" \
    --variants library,rolling_fa3,library_compiled,rolling_fa3_compiled,library_fp8_compiled --chunks-timed 3 \
    --out "$out/fa3_compiled_cfg_$1"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
for what in "$@"; do
  case $what in
    # ~240-280 s warm (H100 stop 56: 169 of 177 tests in 235 s); 420 s leaves room for a JIT build
    tests) step gpu_tests 420 python3 -m pytest -m gpu -q -p no:cacheprovider tests -rs ;;
    # The GPU tests a change to FP8 quantization, compiled graphs or CUDA graphs can reach (53 of them).
    tests_fp8) step gpu_tests_fp8 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests -rs \
               -k "fp8 or quant or compiled or graph" ;;
    tests_plan_skip) step gpu_tests_plan_skip 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_flashinfer.py \
               -k plan_skipped -rs ;;
    attention) step attention 200 python3 -m benchmarks.attention --out "$out" ;;
    sessions) step sessions 240 python3 -m benchmarks.sessions --out "$out" ;;
    # The default set (library, rolling_fa3, rolling_sdpa, rolling_flex), CFG on and off: ~8 min before rolling_fa3
    # joined it (compiled flex is most of it); rolling_fa3 adds ~1 min (estimate, not measured yet).
    end_to_end) step end_to_end 570 python3 -m benchmarks.end_to_end --out "$out" ;;
    # The issue-14 configuration, its rows pinned (--compile now also adds rolling_fa3_compiled): the committed
    # results/end_to_end_compiled_h200.* came from it.
    end_to_end_compiled) step end_to_end_compiled 540 python3 -m benchmarks.end_to_end --cfg on --variants \
               library,rolling_sdpa,library_compiled,rolling_sdpa_compiled,library_fp8,library_fp8_compiled \
               --chunks-timed 3 --out "$out/compiled" ;;
    # Issue 28: the honest baseline, rolling buffer + FlashInfer ragged FA3 (flash_attn_interface's stand-in).
    # Eager, CFG on and off: library vs rolling_fa3 (the baseline) and rolling_sdpa (secondary). Estimate ~3 min.
    end_to_end_fa3) step end_to_end_fa3 300 python3 -m benchmarks.end_to_end \
               --variants library,rolling_fa3,rolling_sdpa --chunks-timed 3 --out "$out/fa3" ;;
    # Compiled (+ FP8 KV) vs rolling_fa3_compiled, CFG on and off: --compile --fp8's rows without the secondary
    # rolling_sdpa_compiled and the eager library_fp8 (one compile and ~1 min less per CFG setting). One process
    # per CFG setting, so a setting that overruns loses only its own JSON; both fit one device command (< 600 s,
    # estimated: 3 compiles per setting at ~1 min each). Or run end_to_end_fa3_compiled_on / _off alone.
    end_to_end_fa3_compiled) fa3_compiled on 290; fa3_compiled off 280 ;;
    end_to_end_fa3_compiled_on) fa3_compiled on 330 ;;
    end_to_end_fa3_compiled_off) fa3_compiled off 330 ;;
    # vllm-omni #7816: 4 forwards per chunk (the last denoising forward commits) vs 5 (a clean commit forward),
    # compiled, CFG on: the library and the FA3 baseline both ways (each compiled once), the produced latents
    # compared chunk by chunk (--commit-forward both). Estimate ~5 min.
    end_to_end_four_forwards) step end_to_end_four_forwards 450 python3 -m benchmarks.end_to_end --cfg on \
               --commit-forward both --variants library,rolling_fa3,library_compiled,rolling_fa3_compiled \
               --chunks-timed 3 --out "$out/four_forwards" ;;
    end_to_end_fp8) step end_to_end_fp8 330 python3 -m benchmarks.end_to_end --cfg on \
               --variants library,rolling_sdpa_compiled,library_fp8_compiled --chunks-timed 3 --out "$out/compiled_fp8" ;;
    # --compile adds rolling_fa3_compiled here too since issue 28 (+1 compile and its steps: limit 250 -> 330).
    end_to_end_graph_14b) step end_to_end_graph_14b 330 python3 -m benchmarks.end_to_end --preset wan14b-like \
               --compile --graph --cfg on --variants library --chunks-timed 5 --out "$out/graph_14b" ;;
    tests_graphs) step gpu_tests_graphs 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_graphs.py -rs ;;
    nccl_graph_probe_1) step nccl_graph_probe_1 120 torchrun --nproc-per-node 1 -m benchmarks.nccl_graph_probe ;;
    example_distributed) step example_distributed 200 torchrun --nproc-per-node 2 examples/distributed_generation.py \
               --device cuda --preset wan2.1-1.3b --chunks 4 --check --json "$out/distributed_generation.json" ;;
    ulysses_rank) step ulysses_rank 240 python3 -m benchmarks.ulysses_rank --profile --out "$out/ulysses_rank" ;;
    ulysses_rank_compiled) step ulysses_rank_compiled 240 python3 -m benchmarks.ulysses_rank --compile --layers 4 \
               --out "$out/ulysses_rank" ;;
    tests_multi_gpu) step gpu_tests_multi_gpu 330 python3 -m pytest -m gpu -q -p no:cacheprovider \
               tests/distributed/test_multi_process.py -rs ;;
    tests_multi_gpu_graphs) step gpu_tests_multi_gpu_graphs 200 python3 -m pytest -m gpu -q \
               -p no:cacheprovider tests/distributed/test_multi_process.py -k graph -rs ;;
    multi_gpu) step multi_gpu 300 python3 -m benchmarks.multi_gpu --steps 3 --out "$out" ;;
    tests_relative_sinks) step gpu_tests_relative_sinks 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
               tests/gpu/test_relative_sinks.py tests/attention/test_rolling.py tests/recache/test_recache.py -rs ;;
    end_to_end_relative) step end_to_end_relative 420 python3 -m benchmarks.end_to_end --cfg on \
               --variants library,library_relative_sinks,library_compiled,library_relative_sinks_compiled \
               --chunks-timed 6 --out "$out/relative_sinks" ;;
    example_recache) step example_recache 150 python3 examples/streaming_generation.py --preset wan2.1-1.3b \
               --device cuda --chunks 12 --switch-at 9 --recache-on-switch --relative-sinks --no-progress \
               --no-plot --out "$out/recache/stream.png" ;;
    multi_gpu_14b) step multi_gpu_14b 300 python3 -m benchmarks.multi_gpu --shapes wan-14b --steps 3 --out "$out/mg14" ;;
    multi_gpu_14b_tokens) step multi_gpu_14b_tokens 250 python3 -m benchmarks.multi_gpu --shapes wan-14b --layouts single,ulysses --steps 3 \
               --cross-attention tokens --out "$out/mg14_tokens" ;;
    nccl_graph_probe) step nccl_graph_probe 120 torchrun --nproc-per-node 2 -m benchmarks.nccl_graph_probe ;;
    tests_gpu_relative_sinks) step gpu_tests_gpu_relative_sinks 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
               tests/gpu/test_relative_sinks.py -rs ;;
    multi_gpu_14b_tokens_compiled) step multi_gpu_14b_tokens_compiled 300 python3 -m benchmarks.multi_gpu --shapes wan-14b \
               --layouts single,ulysses --steps 3 --cross-attention tokens --compile --out "$out/mg14_tokens_compiled" ;;
    multi_gpu_graph) step multi_gpu_graph 300 python3 -m benchmarks.multi_gpu --graph --steps 3 --out "$out/mg_graph" ;;
    multi_gpu_13b) step multi_gpu_13b 150 python3 -m benchmarks.multi_gpu --shapes wan2.1-1.3b --steps 3 --out "$out/mg13" ;;
    multi_gpu_14b_graph) step multi_gpu_14b_graph 200 python3 -m benchmarks.multi_gpu --shapes wan-14b --graph --steps 3 \
               --out "$out/mg14_graph" ;;
    multi_gpu_14b_tokens_graph) step multi_gpu_14b_tokens_graph 200 python3 -m benchmarks.multi_gpu --shapes wan-14b \
               --layouts single,ulysses --graph --steps 3 --cross-attention tokens --out "$out/mg14_tokens_graph" ;;
    multi_gpu_14b_compiled) step multi_gpu_14b_compiled 300 python3 -m benchmarks.multi_gpu --shapes wan-14b \
               --layouts single,ulysses --steps 3 --compile --out "$out/mg14_compiled" ;;
    # The host tier in a serving trace (suspend vs close_idle vs queue): the Wan2.1-1.3B model per tick (5 sessions,
    # a pool for 2; estimate ~2 min: ~25 s of chunk steps per policy, the suspend / resume copies, a 9-step
    # calibration) and the 14B-like attention shape (10 sessions, a pool for 3; estimate ~1 min). Not measured yet.
    serving) step serving 300 python3 -m benchmarks.serving --out "$out" ;;
    # Issue 45 item 4: the serving trace at the 1.3B shape compiled, CFG off (the real-time setting), the four policies
    # (migrate beside suspend, close_idle, queue). Estimate ~5 min: ~2-3 min of compiles (batch 1 and 2, before
    # anything is timed), the per-policy warm-ups, ~10-20 s of trace per policy (each capped at 60 s).
    # Measured (H200, stop 50): compiling the whole model for batch sizes 1..2 took 245 s before the trace began and
    # the step was cut at 330 s. Since stop 51 the blocks are compiled regionally (--compile-scope blocks: one graph
    # per batch size shared by the 30 blocks; not measured on a GPU yet, expected ~1/30 of that compile), so the
    # four policies' traces fit: give this step a device call of its own anyway.
    serving_compiled_cfg_off) step serving_compiled_cfg_off 570 python3 -m benchmarks.serving --compile --cfg off \
               --compile-scope blocks --policy-time-limit 60 --out "$out/serving_compiled_cfg_off" ;;
    serving_14b) step serving_14b 200 python3 -m benchmarks.serving --preset wan14b-like --compute attention \
               --out "$out/serving_14b" ;;
    # Issue 45 item 4: save / load of one Wan2.1-1.3B session (12.3 GB file in /tmp) vs the model's chunk step, the
    # host tier, plain file I/O and the host link (estimate ~3 min; save / load rounds stop past --budget-s 120).
    # Measured (H200, stop 50): one save + load round of the 12.3 GB session took ~60 s (before block digests);
    # results/session_files_h200.* came from --rounds 1 --tier-rounds 3 --disk-rounds 1 --link-rounds 3 (127 s).
    session_files) step session_files 300 python3 -m benchmarks.session_files --rounds 2 --tier-rounds 3 --disk-rounds 1 \
               --link-rounds 3 --out "$out" ;;
    # Issue 45 item 4: send / receive of one Wan2.1-1.3B session between two processes on one GPU (gloo: NCCL refuses
    # two ranks on one device; the pages staged through the host), 3 round trips, beside the wire / d2h / h2d / d2d
    # copies of the same bytes. Estimate ~1-2 min (12 GB over loopback TCP, 6 moves); on 2 GPUs it picks NCCL.
    # Measured (H200, stop 50): no output within 110 s with the defaults (12 GB over loopback TCP, both ways,
    # 3 rounds): one round here, with the full limit.
    session_transport) step session_transport 300 python3 -m benchmarks.session_transport --rounds 1 --link-rounds 2 \
               --out "$out" ;;
    # Issue 45: the CUDA IPC transport (opt-in, never run on a GPU before stop 53): its GPU test (two processes on one
    # GPU: a refused receive after mapping leaves the sender intact; a move by IPC continues bit-identically), then the
    # move timed by IPC beside the wire on the same card (stop 52, H100, wire: 2.79 s per 12.3 GB). Estimate ~2-3 min.
    tests_ipc) step gpu_tests_ipc 150 python3 -m pytest -q -p no:cacheprovider -rs \
               tests/distributed/test_send_recv_ipc.py tests/distributed/test_send_recv.py ;;
    session_transport_ipc) step session_transport_ipc 200 python3 -m benchmarks.session_transport --transport ipc \
               --rounds 2 --link-rounds 1 --out "$out/ipc" ;;
    # Issue 28: where the 14B-like chunk step's time goes, library compiled vs the compiled FA3 peer (and head groups):
    # torch.profiler tables and a gzipped chrome trace per variant under $OUT/e14p. Estimate ~2.5 min.
    # Issue 42 item 4: each table ends with the ardiff_modules ops' CPU total per call -- compare
    # kv_write_slots_plain (was kv_write_slots: 236.6 us) and paged_attention (289.1 us) with
    # results/profiles_14b_like_h200/profile_cfg_off_library_compiled_clean.txt.
    profile_14b) step profile_14b 240 python3 -m benchmarks.end_to_end --preset wan14b-like --cfg off \
               --variants rolling_fa3_compiled,library_compiled,library_heads_compiled --chunks-timed 3 \
               --profile "$out/e14p" --out "$out/e14p" ;;
    # Issue 42 item 3: the rolling-FA3 peer with every trick on (no graph break; CUDA graphs) beside the library's
    # compiled and graphed rows, Wan2.1-1.3B, one CFG setting per step ($1 of peers_cfg_on / peers_cfg_off).
    peers_cfg_on|peers_cfg_off) step "end_to_end_$what" 560 python3 -m benchmarks.end_to_end --cfg "${what#peers_cfg_}" \
               --variants library_compiled,library_compiled_graph,rolling_fa3_compiled,rolling_fa3_compiled_fullgraph,rolling_fa3_compiled_graph \
               --chunks-timed 5 --out "$out/$what" ;;
    # Issue 42: Forcing-KV's published Self-Forcing numbers with its dynamic mode off (every head sink 1 frame + the
    # last frame: FrameWindowPolicy), CFG off, compiled + CUDA graph, beside the graphed peer and full-window library.
    # The same method in Forcing-KV's own path (--forcingkv-dynamic off) beside it: the >= 1.25x target's pair (the
    # same policy per head: library_heads_compiled_graph's outputs checked against forcingkv_own_compiled_graph's).
    frames_cfg_off) step end_to_end_frames_cfg_off 560 python3 -m benchmarks.end_to_end --cfg off \
               --heads benchmarks/configs/forcingkv_selfforcing_static_wan1.3b.json --forcingkv-dynamic off \
               --variants library_heads_compiled_graph,forcingkv_own_compiled_graph,library_compiled_graph,rolling_fa3_compiled_graph \
               --chunks-timed 3 --out "$out/frames_cfg_off" ;;
    # Issue 42: Forcing-KV's published Self-Forcing method WITH its dynamic patches, CFG off (Self-Forcing's setting;
    # dynamic_cfg_on: CFG on, the outputs compared on batch row 0 only), compiled + CUDA graph. The library's rows
    # with --heads forcingkv: the forcingkv_own* peer's configuration (its fixed-seed head map with the published
    # per-layer counts, or FORCINGKV_HEADS=<configs_head/forcingkv_heads_selfforcing.json> for both sides) built by
    # ForcingKVConfig.head_retention, equal to benchmarks/configs/forcingkv_selfforcing_dynamic_wan1.3b.json at the
    # default map; its rows run with 260-token KV pages (one a patch), the full-window rows with the preset's 120.
    # library_heads_compiled_graph's outputs are compared with forcingkv_own_compiled_graph's (same method; in bf16
    # reported, not in the rc: the peer scores patches in bf16, the library in float32). Order: that pair first.
    # Estimate (not measured): the eager library reference ~15 s; library_heads_compiled_graph ~2 min (its
    # static-method twin: 101 s of compile on the H100); forcingkv_own_compiled_graph never measured on a GPU (two
    # graphs to compile; results/end_to_end_frames_cfg_off_first_h100.log ends after the heads row, ~2 min into the
    # 560 s: if that try ran frames_cfg_off as written, the peer, next, did not finish in the ~7 min left);
    # library_compiled_graph ~2 min (106 s of compile);
    # rolling_fa3_compiled_graph a graph per fill level. All four may not fit 560 s: the partial JSON keeps the rows
    # done, and dynamic_pair_cfg_off runs the same-method pair alone.
    dynamic_cfg_on|dynamic_cfg_off) step "end_to_end_$what" 560 python3 -m benchmarks.end_to_end \
               --cfg "${what#dynamic_cfg_}" --heads forcingkv --forcingkv-dynamic on \
               ${FORCINGKV_HEADS:+--forcingkv-heads "$FORCINGKV_HEADS"} \
               --variants library_heads_compiled_graph,forcingkv_own_compiled_graph,library_compiled_graph,rolling_fa3_compiled_graph \
               --chunks-timed 3 --out "$out/$what" ;;
    # Measured (H100, stop 51): 356 s in all (library_heads_compiled_graph's warm-up 109 s, the peer's 209 s).
    dynamic_pair_cfg_off) step end_to_end_dynamic_pair_cfg_off 560 python3 -m benchmarks.end_to_end --cfg off \
               --heads forcingkv --forcingkv-dynamic on ${FORCINGKV_HEADS:+--forcingkv-heads "$FORCINGKV_HEADS"} \
               --variants library_heads_compiled_graph,forcingkv_own_compiled_graph --chunks-timed 3 \
               --out "$out/$what" ;;
    # Issue 42: where the same-method pair's time goes (H100, stop 51: library_heads_compiled_graph 256.2 ms vs
    # forcingkv_own_compiled_graph 239.1 ms, 0.93x): both eager (Forcing-KV as published runs eager) with
    # torch.profiler tables per variant under $OUT/dynp (the lanes' paged FA3 vs the peer's ragged FA3 over its
    # concatenated caches). Estimate ~1.5 min (no compile).
    dynamic_profile_cfg_off) step end_to_end_dynamic_profile_cfg_off 240 python3 -m benchmarks.end_to_end --cfg off \
               --heads forcingkv --forcingkv-dynamic on ${FORCINGKV_HEADS:+--forcingkv-heads "$FORCINGKV_HEADS"} \
               --variants library_heads,forcingkv_own --chunks-timed 3 --profile "$out/dynp" --out "$out/dynp" ;;
    # Issue 42's >= 1.6x target: Forcing-KV's method in the library beside the graphed rolling-FA3 peer (full window),
    # CFG off. H100, stop 52: the library row 251.2 ms after a 79.5 s warm-up; the peer's warm-up (then a compile
    # per fill level) did not finish in the ~245 s left of a 330 s call; its fill phase now runs eager.
    dynamic_peer_cfg_off) step end_to_end_dynamic_peer_cfg_off 560 python3 -m benchmarks.end_to_end --cfg off \
               --heads forcingkv --forcingkv-dynamic on ${FORCINGKV_HEADS:+--forcingkv-heads "$FORCINGKV_HEADS"} \
               --variants library_heads_compiled_graph,rolling_fa3_compiled_graph,library_heads_fp8_compiled_graph \
               --chunks-timed 3 --out "$out/$what" ;;
    # Issue 42's targets against the graphed rolling-FA3 peer in one run, one CFG setting per step: the peer first (its
    # fill phase eager), Forcing-KV's method in the library (bf16; >= 1.6x), the uniform full-window library (>= 1.0x),
    # then FP8 on top of the method (>= 1.8x). The JSON is written after each row, so a cut keeps the rows done.
    # Estimate (stop 52's graphed rows, H100): ~130 s a variant, ~9 min for four: the FP8 row may be cut (stop 56,
    # H100, CFG off: cut there; fp8_fix_profile_cfg_off and graphed_fp8_cfg_on hold the FP8 rows).
    graphed_peers_cfg_on|graphed_peers_cfg_off) step "end_to_end_$what" 560 python3 -m benchmarks.end_to_end \
               --cfg "${what#graphed_peers_cfg_}" \
               --heads forcingkv --forcingkv-dynamic on ${FORCINGKV_HEADS:+--forcingkv-heads "$FORCINGKV_HEADS"} \
               --variants rolling_fa3_compiled_graph,library_heads_compiled_graph,library_compiled_graph,library_heads_fp8_compiled_graph \
               --chunks-timed 3 --out "$out/$what" ;;
    # The CFG-on half of graphed_peers without the full-window row (measured at parity in stop 54): the peer, the
    # method in bf16 and in FP8 after the query-scale fix, side by side. Stop 56, H100: 551 s (warm-ups 187 + 129 +
    # 178 s), so it needs a device call of its own.
    graphed_fp8_cfg_on) step end_to_end_graphed_fp8_cfg_on 580 python3 -m benchmarks.end_to_end --cfg on \
               --heads forcingkv --forcingkv-dynamic on ${FORCINGKV_HEADS:+--forcingkv-heads "$FORCINGKV_HEADS"} \
               --variants rolling_fa3_compiled_graph,library_heads_compiled_graph,library_heads_fp8_compiled_graph \
               --chunks-timed 3 --out "$out/$what" ;;
    # Issue 42: why FP8 K/V make Forcing-KV's method slower (stop 54, H200: 280.4 vs 238.5 ms graphed, CFG off, where
    # at full window FP8 was 1.15x faster): the method's graphed step in bf16 and FP8, each profiled for one more
    # chunk step after timing (torch.profiler under $OUT/fp8p: wall vs device-busy time -- a gap that is not in the
    # kernels is host work or a sync -- the kernel tables, which CUPTI lists from graph replays too, and the
    # timeline). Run it after fp8_lanes (the kernel alone). Estimate ~4 min (two warm-ups of ~95-115 s).
    fp8_heads_profile_cfg_off) step end_to_end_fp8_heads_profile_cfg_off 400 python3 -m benchmarks.end_to_end --cfg off \
               --heads forcingkv --forcingkv-dynamic on ${FORCINGKV_HEADS:+--forcingkv-heads "$FORCINGKV_HEADS"} \
               --variants library_heads_compiled_graph,library_heads_fp8_compiled_graph --chunks-timed 3 \
               --profile "$out/fp8p" --out "$out/fp8p" ;;
    # Issue 42's FP8 fix (stop 55): the per-lane query amax, one reduction over (tokens, dim), compiled to one thread
    # block per head (57 ms of the FP8 step, H100); reduced per row first now. The peer, the bf16 method and the FP8
    # method side by side under the profiler. Estimate ~7.5 min (warm-ups ~160 + 115 + 115 s).
    fp8_fix_profile_cfg_off) step end_to_end_fp8_fix_profile_cfg_off 560 python3 -m benchmarks.end_to_end --cfg off \
               --heads forcingkv --forcingkv-dynamic on ${FORCINGKV_HEADS:+--forcingkv-heads "$FORCINGKV_HEADS"} \
               --variants rolling_fa3_compiled_graph,library_heads_compiled_graph,library_heads_fp8_compiled_graph \
               --chunks-timed 3 --profile "$out/fp8fix" --out "$out/fp8fix" ;;
    # Issue 42's "uniform never below 1.0x": at full window the graphed library is at parity with the graphed peer
    # (stop 54, H200: 0.999x CFG off, 1.014x CFG on), though the peer also rolls its buffer (~0.44 ms a layer per
    # chunk step without CFG: ~3 % of the step) -- so the library spends ~3 % more somewhere. The pair under the
    # profiler (wall vs device busy, kernel tables, timeline under $OUT/unip). Estimate ~5 min (the peer's warm-up
    # ~160 s, the library's ~80 s).
    uniform_profile_cfg_off) step end_to_end_uniform_profile_cfg_off 450 python3 -m benchmarks.end_to_end --cfg off \
               --variants library_compiled_graph,rolling_fa3_compiled_graph --chunks-timed 3 \
               --profile "$out/unip" --out "$out/unip" ;;
    # The same question at the kernel: FA3's FP8 vs bf16 kernel per lane size (1-12 heads over the method's key spans),
    # and the sum over the published layer map beside the end-to-end gap. No compile: estimate ~1 min.
    fp8_lanes) step fp8_lanes 200 python3 -m benchmarks.fp8_lanes --out "$out/fp8_lanes" ;;
    # Issue 42 item 4 on the GPU: op_host_time before (bench_before/: the ops of b95d721, made by
    # `git archive b95d721 ardiff_modules | tar -x -C bench_before && cp -r benchmarks bench_before/`) and after,
    # alternated twice in one call (python -m puts the cwd first on sys.path, so bench_before's tree wins there).
    op_host_time_pair) for r in 1 2; do
               step "op_host_time_before_$r" 100 bash -c "cd bench_before && python3 -m benchmarks.op_host_time \
                   --label before --out $out/op_before_$r"
               step "op_host_time_after_$r" 100 python3 -m benchmarks.op_host_time --label after --out "$out/op_after_$r"
               done ;;
    # The same method with FP8 KV on top (the issue's >= 1.8x target) beside the graphed peer, CFG off.
    dynamic_fp8_cfg_off) step end_to_end_dynamic_fp8_cfg_off 560 python3 -m benchmarks.end_to_end --cfg off \
               --heads forcingkv --forcingkv-dynamic on ${FORCINGKV_HEADS:+--forcingkv-heads "$FORCINGKV_HEADS"} \
               --variants library_heads_fp8_compiled_graph,rolling_fa3_compiled_graph --chunks-timed 3 \
               --out "$out/$what" ;;
    # Issue 43: the Self-Forcing-style training step (Wan2.1-1.3B, 21 frames, every block checkpointed) in both
    # history-gradient modes, library and peer (peer_straight_through: upstream's buffer written with grad, the
    # straight-through library's gradient reference), the four timed side by side, each one's peak memory alone,
    # then the 240-frame long rollout. ~36 steps at ~4.5 s (issue 27's row) + ~30 s: estimate ~4 min, not measured.
    training_modes) step training_modes 560 python3 -m benchmarks.training --out "$out/training_modes" ;;
    # Issue 42 item 3: Forcing-KV's own attention path (benchmarks/forcing_kv_peer.py, its published Self-Forcing
    # config; FORCINGKV_HEADS=<its configs_head/forcingkv_heads_selfforcing.json> to use the published head map,
    # else a fixed-seed map with its per-layer counts) compiled and CUDA-graphed, beside the library's graphed row and
    # the graphed rolling-FA3 peer, Wan2.1-1.3B, one CFG setting per step (off: Self-Forcing's setting). Estimate
    # (not measured): the Forcing-KV rows compile two graphs once (~1.5 min; the graphed row reuses them),
    # library_compiled_graph ~1.5 min, rolling_fa3_compiled_graph a graph per fill level (last: the costliest).
    # Every variant's rows land in end_to_end.partial.json as it finishes, so an overrun keeps the earlier rows.
    forcingkv_peers_cfg_on|forcingkv_peers_cfg_off) step "end_to_end_$what" 560 python3 -m benchmarks.end_to_end \
               --cfg "${what#forcingkv_peers_cfg_}" ${FORCINGKV_HEADS:+--forcingkv-heads "$FORCINGKV_HEADS"} \
               --variants forcingkv_own_compiled,forcingkv_own_compiled_graph,library_compiled_graph,rolling_fa3_compiled_graph \
               --chunks-timed 3 --out "$out/$what" ;;
    head_retention) step head_retention 200 python3 -m benchmarks.head_retention --cfg on,off --out "$out/heads" ;;
    # Issue 28 at the 14B-like shape, CFG on and off, compiled: the peer, the library, per-head retention (~4 min).
    # Issue 42's "compiled step without graphs never below 1.0x the compiled peer at the 14B-like shape in 5 of 5 runs",
    # after the host-cost cuts: five separate runs, CFG off, the variant order alternated run to run (later runs
    # recompile from inductor's on-disk cache). Estimate ~60 s a run (warm-ups 20 + 36 s on the H200, stop 41).
    compiled_14b_five) for r in 1 2 3 4 5; do
               order=rolling_fa3_compiled,library_compiled; [ $((r % 2)) -eq 0 ] && order=library_compiled,rolling_fa3_compiled
               step "end_to_end_14b_run_$r" 110 python3 -m benchmarks.end_to_end --preset wan14b-like --cfg off \
                   --variants "$order" --chunks-timed 5 --out "$out/e14_five/run_$r"
               done ;;
    end_to_end_14b) step end_to_end_14b 330 python3 -m benchmarks.end_to_end --preset wan14b-like \
               --variants rolling_fa3_compiled,library_compiled,library_heads_compiled --chunks-timed 5 --out "$out/e14" ;;
    tests_host) step gpu_tests_host 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/host tests/warm_start -rs ;;
    # Issue 29 item 4: time to first chunk of fresh processes, cold / warm_up / compile cache loaded (10 blocks).
    warm_start) step warm_start 300 python3 -m benchmarks.warm_start --layers 10 --out "$out" ;;
    first_use) step first_use 200 python3 -m benchmarks.first_use --out "$out" ;;
    host_time) step host_time 120 python3 -m benchmarks.host_time --out "$out/host_time.jsonl" ;;
    # Issue 42 item 4: host microseconds of one layer's call into each op (eager chunk_attention, the compiled
    # path's gate + paged_attention, compiled layer), reference and FlashInfer backends. Estimate ~1 min.
    op_host_time) step op_host_time 200 python3 -m benchmarks.op_host_time --out "$out" ;;
    compile_vs_eager) step compile_vs_eager 300 python3 -m benchmarks.compile_vs_eager --out "$out" ;;
    example) step example 150 python3 examples/streaming_generation.py --preset wan2.1-1.3b --device cuda \
               --chunks 10 --switch-at 6 --compile --no-progress --out /tmp/stream_wan.png ;;
    example_graph) step example_graph 150 python3 examples/streaming_generation.py --preset wan2.1-1.3b \
               --device cuda --chunks 10 --switch-at 6 --cuda-graph --no-progress --out /tmp/stream_wan_graph.png ;;
    *) echo "unknown step $what"; status=1 ;;
  esac
done
# The device returns at most 8 files under $OUT (16 MB each): past 7, everything goes back as one archive
# (`tar -xzf results.tar.gz` here), so a batch of steps loses no result (stop 53 lost one JSON so).
files=$(find "$out" -type f | wc -l)
if [ "$files" -gt 7 ]; then
  tar -czf /tmp/ardiff-results.tar.gz -C "$out" . && find "$out" -mindepth 1 -delete && mv /tmp/ardiff-results.tar.gz "$out/results.tar.gz" \
    && echo "run_h200.sh: $files files packed into \$OUT/results.tar.gz ($(du -h "$out/results.tar.gz" | cut -f1))"
fi
exit $status
