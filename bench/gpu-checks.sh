#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one short script for a lent device (run it first: device minutes are
# few). Installs the project into a fresh venv on the device (torch from the device's own index), then:
#   1. the suite's CUDA-marked tests (the Triton rejection sampler and block-table attention kernels in bf16:
#      one compiled variant for every batch);
#   2. the paged runner on CUDA with the block-table kernel against the HF forward (its probe) and 64 greedy
#      tokens of the demo target equal to the HF greedy output; then 4 sequences decoded together, 48 greedy
#      tokens each, with CUDA graphs and without (tokens compared, ms per step of each);
#   3. bench.verify_shapes on CUDA (ms per forward by shape), its JSON under $OUT;
#   4. the real-size pair: the demo target widened to Llama 3.1 8B's shape and the demo draft to Llama 3.2
#      1B's (`specmesh widen`, bf16; the logits stay the demo pair's), bench.verify_shapes on each (paged
#      runner, CUDA graphs on and off: ms per forward at 1 x 1 and 16 x 5), then
#      bench.load through the gateway at 1, 4, 16 and 32 streams, greedy and T = 0.7, with transformers'
#      assisted generation on the same pair: bench/results/*real-pair* (under $OUT).
# Each step is bounded so that the whole fits in 15 minutes of device time; a step that runs out leaves what it
# wrote and the next one starts.
# Usage on the device: OUT=/some/dir bench/gpu-checks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-checks}"
mkdir -p "$OUT"
python3 -m venv /tmp/gpu-venv
/tmp/gpu-venv/bin/pip install -q --upgrade pip
/tmp/gpu-venv/bin/pip install -q torch triton
/tmp/gpu-venv/bin/pip install -q -e '.[test,bench]'
PY=/tmp/gpu-venv/bin/python
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -m pytest -q -m cuda tests/unit/test_block_attention.py tests/unit/test_rejection.py tests/unit/test_paged_runner.py \
  2>&1 | tee "$OUT/cuda-tests.txt"
$PY - <<'PYEOF' 2>&1 | tee "$OUT/paged-kernel.txt"
import torch
from transformers import AutoModelForCausalLM
from specmesh.runtime.paged import PagedRunner

target = AutoModelForCausalLM.from_pretrained("models/demo/target", dtype=torch.bfloat16).to("cuda").eval()
runner = PagedRunner(target, 256, 16, max_model_len=512)
print("block kernel in use after the probe:", runner.block_kernel)
prompt = list(range(5, 40))
seq = runner.new_sequence(prompt)
ours = []
for _ in range(64):
    t = int(runner.forward([seq])[0][-1].argmax())
    seq.commit([t])
    ours.append(t)
hf = target.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
agree = sum(a == b for a, b in zip(ours, hf))
print(f"greedy agreement with HF generate (bf16): {agree}/64; first divergence at {next((i for i, (a, b) in enumerate(zip(ours, hf)) if a != b), None)}")

import time
def decode(r, n=48):
    seqs = [r.new_sequence(list(range(5 + i, 30 + 3 * i))) for i in range(4)]
    out, ms = [[] for _ in seqs], []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        logits = r.forward(seqs)
        torch.cuda.synchronize(); ms.append((time.perf_counter() - t0) * 1e3)
        for s, l, o in zip(seqs, logits, out):
            t = int(l[-1].argmax()); s.commit([t]); o.append(t)
    for s in seqs:
        r.free(s)
    return out, sorted(ms)[len(ms) // 2]
graphed = PagedRunner(target, 256, 16, max_model_len=512, cuda_graph_max_bs=8, graph_tokens_per_seq=5)
eager_out, eager_ms = decode(runner)
graph_out, graph_ms = decode(graphed)
same = sum(a == b for x, y in zip(eager_out, graph_out) for a, b in zip(x, y))
print(f"CUDA graphs: {graphed.graphs.captures} captured; 4 x 48 greedy tokens equal with and without: {same}/192; "
      f"p50 ms per step eager {eager_ms:.2f}, graphs {graph_ms:.2f} ({graphed.graphs.replays} replays)")
PYEOF
$PY -m bench.verify_shapes --device cuda --streams 1,16 --out "$OUT/verify-shapes-cuda.json" 2>&1 | tail -20 | tee "$OUT/verify-shapes.txt"
REAL=/tmp/real-pair
rm -rf "$REAL"
timeout 240 $PY -m specmesh widen --source models/demo/target --out "$REAL/target" --preset llama-3.1-8b --dtype bfloat16 \
  2>&1 | tee "$OUT/widen.txt" || true
timeout 60 $PY -m specmesh widen --source models/demo/draft --out "$REAL/draft" --preset llama-3.2-1b --dtype bfloat16 \
  2>&1 | tee -a "$OUT/widen.txt" || true
for m in target draft; do
  for g in on off; do
    timeout 90 $PY -m bench.verify_shapes --device cuda --target "$REAL/$m" --streams 1,16 --backends no-cudnn \
      --tokens 32 --runner paged --cuda-graphs $g --out "$OUT/verify-shapes-real-pair-$m-graphs-$g.json" 2>&1 \
      | tail -12 | tee "$OUT/verify-shapes-real-pair-$m-graphs-$g.txt" || true
  done
done
timeout 360 $PY -m bench.load --device cuda --target "$REAL/target" --draft "$REAL/draft" --concurrency 1,4,16,32 \
  --temperatures 0,0.7 --requests-factor 1 --repeats 1 --hf-prompts 4 --old-runtime '' \
  --out "$OUT/load-real-pair.json" 2>&1 | tail -30 | tee "$OUT/load-real-pair.txt" || true
