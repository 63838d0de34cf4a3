#!/usr/bin/env bash
# The steps of one lease of the GPU machine (see docs/gpu.md): run from the repository root after
# `. /opt/cm-gpu/env.sh`. Every step has its own time limit and writes its log under $OUT, so a
# step that hangs or fails does not take the others' results with it. To run the GPU tests in
# parallel processes, carry pytest-xdist's wheels in .whl/ (git-ignored) with the call:
#   pip download --no-deps -d .whl pytest-xdist execnet
#   bash bench/h200.sh tests     # every gpu-marked test
#   bash bench/h200.sh variants  # the backward's tests with the mma.sync kernel
#   bash bench/h200.sh knobs     # the non-default variants' GPU tests (fwd compare, bwd cp.async)
#   bash bench/h200.sh knobs_time  # train-step timing per knob combination, 8K and 32K
#   MASK=hstu bash bench/h200.sh study  # train 1K-16K for one mask (SEQLENS="1024 2048" to split
#                                       # it over calls; merge the calls' JSON with --merge)
#   bash bench/h200.sh ncu       # Nsight Compute: one train step, ours vs FA4 (MASK=, S=)
#   AB="X=a X=b" bash bench/h200.sh envab  # two knob settings, interleaved (MODE=fwd|train)
#   bash bench/h200.sh check     # the gpu tests of the preprocess, the backward and end to end
#   bash bench/h200.sh pre       # preprocess table (+ threads sweep); memcheck of a small case
#   bash bench/h200.sh fwd       # forward vs peers at 32K (MASKS=... to choose)
#   bash bench/h200.sh train     # preprocess + forward + backward vs peers (32K; SEQLENS=)
#   bash bench/h200.sh det       # deterministic=True: GPU tests and its cost
#   bash bench/h200.sh loop      # a new length every step: compiles and step times per mask
#   bash bench/h200.sh serving   # decode steps vs FA4's own; prefill + mask build vs Flex-FA4
#   MASK=causal:alibi bash bench/h200.sh flexcode  # Flex-FA4's generated score_mod / mask_mod
#   bash bench/h200.sh columns   # the backward masked by the column view vs the default, Flex
#   MASK=hstu bash bench/h200.sh samples  # every sample of a train step, with clocks and power
#   bash bench/h200.sh scoremod  # the score_mod pairs vs Flex-FA4 (rounds), ALiBi's variants
#   MASKS=hstu bash bench/h200.sh e2e  # Qwen3 training steps, one attention per backend (32K;
#                                      # SEQLENS=, BACKENDS=, LAYERS=, STEPS=; one mask a call)
set -u
OUT=${OUT:-/tmp/cm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# pytest-xdist, when its wheels were carried in .whl/ (docs/gpu.md): the GPU tests' kernel
# compiles run in parallel processes (one GPU; NPROC=1 to run them one by one)
if [ -d .whl ] && ! python3 -c "import xdist" 2>/dev/null; then
  pip install -q --no-index --no-deps .whl/*.whl >/dev/null 2>&1 || true
fi
PAR=""
if python3 -c "import xdist" 2>/dev/null && [ "${NPROC:-8}" != 1 ]; then PAR="-n ${NPROC:-8}"; fi
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc $((SECONDS - t0))s :: $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"
}
# --rep is triton's do_bench budget in ms: a 50 ms train step at --rep 100 is two samples, and
# the H200 runs these kernels at its power cap (clocks 1.4-1.75 GHz from one moment to the
# next), so such a median moves 10%; the round-based steps default to --rep 400 (8 samples;
# bench/samples.py prints each with the clocks); the compiles, not the timing, take the time
case "${1:-}" in
  tests)  # every gpu-marked test (the non-default variants' too; knobs runs those alone)
    step gpu_tests 540 python3 -m pytest -q $PAR -m gpu -p no:cacheprovider tests
    ;;
  variants)  # the backward's GPU tests with the mma.sync kernel (the portable path: the
    # arch=80 parametrizations, KernelOptions(bwd_arch=80))
    step bwd_sm80 170 python3 -m pytest -q $PAR -m gpu -k 80 \
      -p no:cacheprovider tests/test_kernel_bwd.py
    ;;
  knobs)  # the GPU tests of the non-default variants: the forward's interval compares on sm90
    # (the -compare variants, KernelOptions(fwd_mask="compare")) and the backward's row
    # metadata forced both ways at every K (KernelOptions(bwd_meta="async"|"regs")); each test
    # passes its options (-x: stop at the first failure)
    step fwd_bwd_variants 280 python3 -m pytest -q $PAR -m gpu -x -p no:cacheprovider \
      tests/test_kernel_fwd.py tests/test_kernel_bwd.py -k "compare or meta_async"
    ;;
  knobs_time)  # a train step (forward and backward times) per knob combination, 8K and 32K,
    # cm only: a the defaults (fwd partial tiles by bits; bwd row metadata in registers for
    # K <= 2, by cp.async for K > 2), b fwd compare + bwd registers, c bwd cp.async at every K.
    # Forward and backward knobs act on different kernels: fwd compare is b vs a; bwd registers
    # at K > 2 (clear) b vs a, bwd cp.async at K <= 2 (hstu, shared_prompt_rm, causal) c vs a
    # (KNOBS="a c" to run some; SEQLENS=32768 to shorten)
    for v in a: b:fwd_mask=compare,bwd_meta=regs c:bwd_meta=async; do
      k=${v%%:*}; opts=${v#*:}
      case " ${KNOBS:-a b c} " in *" $k "*) ;; *) continue ;; esac
      step "train_knobs_$k" 120 python3 bench/attention.py --mode train --options "$opts" \
        --seqlens "${SEQLENS:-8192,32768}" --rep "${REP:-300}" \
        --masks clear,hstu,shared_prompt_rm,causal --methods cm --out "$OUT" --tag "knobs_$k"
      echo "$k ${opts:-defaults}"
      grep -E "^\| (clear|hstu|shared|causal)" "$OUT"/attention_train_knobs_${k}_*.md \
        | cut -d'|' -f2,3,5,12,13
    done
    ;;
  ncu)  # Nsight Compute on one train step of ours and of FA4 (causal 8K by default; MASK=,
    # S=): per kernel, duration, tensor-pipe and issue activity, warp stall reasons. Firecracker
    # machines only (gVisor has no counters); the clocks are left alone (METHOD.md)
    step ncu 420 ncu --clock-control none --nvtx --nvtx-include "measure_cm/" --nvtx-include "measure_fa4/" \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section LaunchStats --section InstructionStats --section ComputeWorkloadAnalysis \
      --metrics sass__inst_executed_per_opcode --export "$OUT/ncu_${MASK:-causal}" --force-overwrite \
      python3 bench/ncu_case.py --mask "${MASK:-causal}" --seqlen "${S:-8192}"
    tail -3 "$OUT/ncu.log"
    ncu --import "$OUT/ncu_${MASK:-causal}.ncu-rep" --page details --csv 2>/dev/null \
      > "$OUT/ncu_${MASK:-causal}.csv"
    python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1])))
keep=('Duration','Compute (SM) Throughput','Issue Slots Busy','Registers Per Thread',
      'Stall Long Scoreboard','Stall Barrier','Stall Wait','Stall Math Pipe Throttle',
      'Stall MIO Throttle','Stall Short Scoreboard','No Eligible','Warp Cycles Per Issued Instruction')
for r in rows:
    if any(r.get('Metric Name','').startswith(k) for k in keep):
        print(r.get('Kernel Name','')[:60], '|', r['Metric Name'], '|', r['Metric Value'], r.get('Metric Unit',''))
" "$OUT/ncu_${MASK:-causal}.csv" | head -80
    # raw metrics: instructions executed, stall reasons per issue, the opcode mix
    ncu --import "$OUT/ncu_${MASK:-causal}.ncu-rep" --page raw --csv 2>/dev/null \
      > "$OUT/ncu_${MASK:-causal}_raw.csv"
    ;;
  ncu_src)  # Nsight Compute source counters of the four attention kernels (ours and FA4's
    # forward and backward, causal 8K by default): executed instructions per SASS line, to find
    # where ours executes more (written compressed: $OUT/ncu_src_*.csv.xz)
    step ncu_src 300 ncu --clock-control none --nvtx --nvtx-include "measure_cm/" \
      --nvtx-include "measure_fa4/" \
      --kernel-name 'regex:FlashFwdSm90|FlashBwdSm90|FlashAttentionForwardSm90|FlashAttentionBackwardSm90' \
      --section SourceCounters --section InstructionStats --export "$OUT/ncu_src" --force-overwrite \
      python3 bench/ncu_case.py --mask "${MASK:-causal}" --seqlen "${S:-8192}"
    tail -2 "$OUT/ncu_src.log"
    ncu --import "$OUT/ncu_src.ncu-rep" --page source --csv --print-source sass 2>&1 \
      | xz -T0 > "$OUT/ncu_src_${MASK:-causal}.csv.xz"
    ls -la "$OUT"; rm -f "$OUT/ncu_src.ncu-rep"
    ;;
  ab)  # A/B timing: the older tree in .old/ (made by bench/ab_tree.sh COMMIT; carry ".old"
    # with the call) against this one, interleaved, cm only
    for r in 1 2; do
      for side in old new; do
        root=.; [ $side = old ] && root=.old
        step "train_ab_${side}_$r" 200 python3 $root/bench/attention.py --mode train \
          --seqlens "${SEQLENS:-32768}" --rep "${REP:-300}" --masks "${MASKS:-hstu,causal,clear}" \
          --methods cm --out "$OUT" --tag "ab_${side}_$r"
        echo "$side $r"
        grep -E "^\| (clear|hstu|shared|causal)" "$OUT"/attention_train_ab_${side}_${r}_*.md \
          | cut -d'|' -f2,3,5,12,13
      done
    done
    ;;
  envab)  # A/B timing of two kernel-option settings in one tree, interleaved, cm only:
    # AB="fwd_mask=bits fwd_mask=compare" MODE=fwd|train (compilemask.KernelOptions fields;
    # a setting of several joins them with commas: bwd_meta=async,fwd_mask=compare)
    for r in $(seq "${ROUNDS:-2}"); do
      for kv in ${AB:?AB=\"field=a field=b\"}; do
        tag="ab_${kv//[^A-Za-z0-9]/_}_$r"
        step "${MODE:-fwd}_$tag" 200 python3 bench/attention.py --mode "${MODE:-fwd}" --options "$kv" \
          --seqlens "${SEQLENS:-32768}" --rep "${REP:-300}" \
          --masks "${MASKS:-hstu,causal,clear,shared_prompt_rm}" --methods cm --out "$OUT" \
          --tag "$tag"
        echo "$kv $r"
        grep -E "^\| (clear|hstu|shared|causal)" "$OUT"/attention_${MODE:-fwd}_${tag}_*.md \
          | cut -c1-160
      done
    done
    ;;
  check)  # after a preprocess or backward change: the tests those paths touch
    step gpu_check 330 python3 -m pytest -q $PAR -m gpu -p no:cacheprovider \
      tests/test_tilelang_preprocess.py tests/test_kernel_bwd.py tests/test_gpu_end_to_end.py \
      tests/test_autograd_op.py
    ;;
  pre)
    step preprocess 280 python3 bench/preprocess.py --out "$OUT/preprocess.md" \
      --flex-seqlens 32768 --flex-masks "${FLEX_MASKS:-hstu,clear}" \
      --sweep "${SWEEP:-512:linear,512:linear:vec,256:linear,256:linear:vec}"
    # --report-api-errors no: cuda-python probes driver entry points that this driver lacks
    # (cuGetProcAddress errors), which are not memory errors
    step memcheck 240 "$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)" \
      --tool memcheck --report-api-errors no --error-exitcode 9 \
      python3 bench/memcheck_case.py
    tail -4 "$OUT/memcheck.log"
    ;;
  fwd)
    step fwd32k 560 python3 bench/attention.py --mode fwd --seqlens 32768 --rep "${REP:-500}" \
      --masks "${MASKS:-shared_prompt_rm,clear,hstu}" --methods cm,flex_triton,flex_flash,fa4 \
      --out "$OUT" --tag 32k
    ;;
  det)  # the deterministic backward's GPU tests and its cost (HSTU and causal, 8K and 32K)
    step bwd_det 200 python3 -m pytest -q $PAR -m gpu -p no:cacheprovider tests/test_kernel_bwd.py \
      -k deterministic
    for flag in "" --deterministic; do
      step "train_det${flag:+_on}" 150 python3 bench/attention.py --mode train \
        --seqlens 8192,32768 --rep 100 --masks hstu,causal --methods cm --out "$OUT" \
        --tag "det${flag:+_on}" $flag
    done
    ;;
  train)  # SEQLENS=1024,4096 MASKS=hstu METHODS=... to choose (default: all masks at 32K)
    tag=${SEQLENS:+s${SEQLENS//,/-}}
    step "train_${tag:-32k}" 570 python3 bench/attention.py --mode train \
      --seqlens "${SEQLENS:-32768}" --rep "${REP:-500}" \
      --masks "${MASKS:-hstu,causal,shared_prompt_rm,clear}" \
      --methods "${METHODS:-cm,flex_flash,fa4,flex_triton}" --out "$OUT" --tag "${tag:-32k}"
    ;;
  study)  # the 1K-16K train points of one mask (MASK=hstu|causal|shared_prompt_rm|clear), one
    # process per sequence length: in one process the Flex peers ran out of memory at 16K on
    # what the earlier shapes left (a fresh process at 16K did not); merged into one table here
    for S in ${SEQLENS:-1024 2048 4096 8192 16384}; do
      step "train_study_${MASK:?MASK=...}_$S" 150 python3 bench/attention.py --mode train \
        --seqlens "$S" --rep "${REP:-30}" --masks "$MASK" \
        --methods "${METHODS:-cm,flex_flash,flex_triton,fa4,sdpa}" --out "$OUT" \
        --tag "study_${MASK}_$S"
    done
    python3 bench/attention.py --mode train --out "$OUT" --tag "study_$MASK" \
      --merge "$OUT"/attention_train_study_"${MASK}"_*.json | grep -E "^\| $MASK"
    ;;
  engines)  # the engine decision: every engine and peer per mask (SEQLENS=, MODES=, MASKS=,
    # METHODS=, ROUNDS= interleaved rounds per point, 4 by default: ratios within 2% need
    # them); FA4's compiled kernels cached on the machine's disk between calls
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
    step "engines_${TAG:-run}" "${SECS:-560}" python3 bench/engines.py --seqlens "${SEQLENS:-32768}" \
      --modes "${MODES:-fwd,train}" --rep "${REP:-300}" --rounds "${ROUNDS:-4}" \
      ${MASKS:+--masks "$MASKS"} ${METHODS:+--methods "$METHODS"} --out "$OUT" --tag "engines_${TAG:-run}"
    grep -E "^\| " "$OUT/engines_${TAG:-run}.md" | cut -c1-400
    ;;
  fa4tests)  # the FA4 engines' GPU tests and the end-to-end product path
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
    step fa4_tests "${SECS:-400}" python3 -m pytest -q $PAR -m gpu -x -p no:cacheprovider \
      tests/test_fa4_engine.py tests/test_gpu_end_to_end.py ${EXTRA_TESTS:-}
    ;;
  e2e)  # end-to-end training (bench/train_e2e.py), one process per mask so that a mask that
    # fails or runs out of memory leaves the others alone; 4 layers, compiled: 40-90 s per
    # backend at 32K, 25-60 s at 8K (the first compile of a process is the long one), so two
    # or three masks of two backends fit a call; merge the calls' JSON with
    # python3 bench/train_e2e.py --merge .../train_e2e_e2e_*.json --tag e2e
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
    MASKS=${MASKS:-hstu,hstu_packed,shared_prompt_rm,clear,causal}
    seqlens=${SEQLENS:-32768}
    for m in ${MASKS//,/ }; do
      tag="e2e_${m}_s${seqlens//,/-}"
      step "$tag" "${SECS:-560}" python3 bench/train_e2e.py --masks "$m" --seqlens "$seqlens" \
        ${BACKENDS:+--backends "$BACKENDS"} --layers "${LAYERS:-4}" --steps "${STEPS:-20}" \
        --out "$OUT" --tag "$tag"
      grep -E "^(\| |WARNING)" "$OUT/train_e2e_$tag.md" 2>/dev/null | cut -c1-300
    done
    ;;
  loop)  # a training loop with a new length every step (bench/dynamic_loop.py), one process
    # per mask, each with an empty cache folder (everything it needs compiles in it), then
    # the first 32K HSTU step of a second process over a warm cache (MASKS=, STEPS=); the
    # results come back as one archive, loop.tar.gz
    L=/tmp/loop-out; mkdir -p $L
    for m in $(echo "${MASKS:-hstu,shared_prompt_rm,clear,causal,packed_documents,sink_window}" | tr , " "); do
      COMPILEMASK_CACHE_DIR=$(mktemp -d) OUT=$L step "loop_$m" "${SECS:-150}" \
        python3 bench/dynamic_loop.py --masks "$m" --steps "${STEPS:-50}" --out "$L/$m" ${LOOP_ARGS:-}
      grep -E "^\| $m" "$L/$m"/dynamic_loop_*.md
    done
    if [ "${SECOND:-1}" = 1 ]; then
      COMPILEMASK_CACHE_DIR=$(mktemp -d) OUT=$L step second_process 200 python3 \
        bench/dynamic_loop.py --second-process --out "$L"
      cat "$L"/second_process_*.json
    fi
    tar czf "$OUT/loop.tar.gz" -C "$L" .
    ;;
  loop_segments)  # packed documents' cold steps (a new length every step), ours against
    # flash-attn-4 called directly over the same steps (--peer fa4: varlen over the documents,
    # and causal), each also with one large cached allocator segment (--reserve-gib 24); the
    # earlier variants (--phases --profile, --kernel-profile, --max-segments 1024, expandable
    # segments) stay flags of bench/dynamic_loop.py
    L=/tmp/loopseg-out; mkdir -p $L; export COMPILEMASK_CACHE_DIR=$(mktemp -d)
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
    M="--steps ${STEPS:-50}"
    [ -n "${PEER_ONLY:-}" ] || OUT=$L step seg_plain 120 python3 bench/dynamic_loop.py $M --masks packed_documents --out "$L/plain"
    OUT=$L step seg_peer 150 python3 bench/dynamic_loop.py $M --masks packed_documents,causal \
      --peer fa4 --out "$L/peer"
    [ -n "${PEER_ONLY:-}" ] || OUT=$L step seg_reserve 120 python3 bench/dynamic_loop.py $M --masks packed_documents \
      --reserve-gib 24 --out "$L/reserve"
    OUT=$L step seg_peer_reserve 150 python3 bench/dynamic_loop.py $M \
      --masks packed_documents,causal --peer fa4 --reserve-gib 24 --out "$L/peer_reserve"
    for v in plain peer reserve peer_reserve; do grep -H -E '^\| (packed|causal)' $L/$v/*.md; done
    tar czf "$OUT/loop_segments.tar.gz" -C "$L" .
    ;;
  timeline)  # packed documents' cold steps: where the GPU idles inside a step, cold vs warm
    COMPILEMASK_CACHE_DIR=$(mktemp -d) step timeline "${SECS:-150}" python3 bench/dynamic_loop.py \
      --masks packed_documents --steps "${STEPS:-30}" --timeline --out "$OUT/timeline"
    head -24 "$OUT"/timeline/kernels_packed_documents.txt
    ;;
  partial)  # the fa4 engine's partial-tile test per mask: default, each mask_mod variant, the
    # always-True ceiling and the peers, train at 8K and 32K, interleaved rounds (MASKS=,
    # METHODS=; a mask:score_mod such as prefix_lm:t5 times each variant with the score_mod)
    step partial "${SECS:-420}" python3 bench/engines.py --modes train --rep "${REP:-400}" \
      --rounds "${ROUNDS:-4}" --seqlens "${SEQLENS:-8192,32768}" --tag "partial_${TAG:-a}" \
      --out "$OUT" \
      --masks "${MASKS:-sink_window,chunked_causal,block_causal}" \
      --methods "${METHODS:-native,fa4,fa4_intervals,fa4_true,fa4_native,flex_flash}"
    cat "$OUT/partial_${TAG:-a}.md"
    ;;
  columns)  # the backward masked by the column view against the Interval Table default and
    # Flex-FA4, train, interleaved rounds (MASKS=, SEQLENS=, ROUNDS=), then its GPU tests
    step columns "${SECS:-480}" python3 bench/engines.py --modes train --rep "${REP:-400}" \
      --rounds "${ROUNDS:-4}" --seqlens "${SEQLENS:-32768,8192}" --tag "columns_${TAG:-a}" \
      --out "$OUT" --masks "${MASKS:-shared_prompt_rm,clear,prefix_lm,sink_window}" \
      --methods "${METHODS:-fa4,fa4_cols,fa4_true,flex_flash,fa4_cols+pre}"
    cat "$OUT/columns_${TAG:-a}.md"
    step columns_tests 300 python3 -m pytest -q -m gpu tests/test_fa4_colmask.py
    ;;
  samples)  # every sample of one mask's train step with the GPU's clocks (MASK=, S=)
    step samples "${SECS:-200}" python3 bench/samples.py --mask "${MASK:-hstu}" \
      --seqlen "${S:-32768}"
    cat "$OUT/samples.log"
    ;;
  scoremod)  # the score_mod pairs against Flex-FA4 with the same score_mod, train, interleaved
    # rounds (MASKS=, SEQLENS=, ROUNDS=); ALiBi + causal's engines and backward variants at
    # 32K; then the score_mod GPU tests
    step scoremod "${SECS:-420}" python3 bench/engines.py --modes train --rep "${REP:-400}" \
      --rounds "${ROUNDS:-4}" --seqlens "${SEQLENS:-32768,8192}" --tag "scoremod_${TAG:-a}" \
      --out "$OUT" --methods "${METHODS:-native,fa4,flex_flash}" \
      --masks "${MASKS:-causal:alibi,sliding_window:softcap,prefix_lm:t5,hstu:temperature}"
    cat "$OUT/scoremod_${TAG:-a}.md"
    step alibi_train 300 python3 bench/alibi_train.py 32768
    tail -12 "$OUT/alibi_train.log"
    step scoremod_tests 300 python3 -m pytest -q $PAR -m gpu tests/test_score_mod.py
    ;;
  serving)  # decode steps against FA4's own kernel, then prefill with the per-request mask
    # build against Flex-FA4 with create_block_mask (forward only, 8K and 32K)
    step serving_decode 260 python3 bench/serving.py --queries "${QUERIES:-1,4}" \
      --page-size "${PAGE_SIZES:-128,64}" --out "$OUT"
    cat "$OUT/serving_decode.md"
    step serving_prefill 380 python3 bench/engines.py --modes fwd --rep "${REP:-100}" \
      --seqlens "${SEQLENS:-8192,32768}" --tag serving_prefill --out "$OUT" \
      --masks "${MASKS:-hstu,tree_verify,shared_prompt_rm,prefix_lm}" \
      --methods preprocess,native,fa4,flex_flash
    cat "$OUT/serving_prefill.md"
    ;;
  flexcode)  # Flex-FA4's generated CuTe code (score_mod, mask_mod, the FA4 call) for one
    # mask:score_mod point (MASK=causal:alibi S=32768), beside ours (bench/sass_score_mod.py
    # prints our score_mod's SASS on the CPU): inductor's output code, compressed
    export TORCH_LOGS=output_code
    step flexcode "${SECS:-300}" python3 bench/engines.py --modes train \
      --rep 30 --seqlens "${S:-32768}" --masks "${MASK:-causal:alibi}" --methods flex_flash \
      --tag flexcode --out "$OUT"
    grep -n "def score_mod\|def mask_mod\|_flash_attn_fwd\|_flash_attn_bwd\|vec_size" \
      "$OUT/flexcode.log" | head -40
    xz -T0 "$OUT/flexcode.log"
    ;;
  *) echo "usage: bash bench/h200.sh tests|variants|knobs|knobs_time|ncu|ncu_src|ab|envab|check|pre|fwd|train|det|study|engines|fa4tests|e2e|loop|loop_segments|timeline|partial|columns|samples|scoremod|serving|flexcode"; exit 2 ;;
esac
