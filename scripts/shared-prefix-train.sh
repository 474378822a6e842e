#!/usr/bin/env bash
# The shared-prefix actor update against the unshared one in `hilore train`: for
# --policy recompute (full recompute) and --policy hilore, runs with --shared-prefix (the
# default) and --no-shared-prefix alternate (A B A B ...), REPS times each, 10 GRPO steps, seed 3. Prints
# each arm's actor-update seconds over steps 3-10 (the first steps calibrate or warm up),
# their median, the whole process's wall and CPU seconds, and the held-out accuracy.
#
#   scripts/shared-prefix-train.sh [BINARY] [REPS] [WORK_DIR]
set -euo pipefail
bin=$(realpath "${1:-target/release/hilore}"); reps=${2:-3}; dir=${3:-$(mktemp -d)}
mkdir -p "$dir"; cd "$dir"
for rep in $(seq "$reps"); do
  for pol in recompute hilore; do
    for v in plain shared; do
      flag=(--no-shared-prefix); [ "$v" = shared ] && flag=(--shared-prefix)
      /usr/bin/time -f "%e %U %S" -o "t-$pol-$v-$rep.txt" "$bin" train --policy "$pol" \
        --seed 3 --steps 10 --no-progress --force "${flag[@]}" --metrics "m-$pol-$v-$rep.jsonl" \
        --summary "s-$pol-$v-$rep.json" --checkpoint c.ckpt > /dev/null 2>&1
    done
  done
done
python3 - "$reps" <<'PY'
import json, statistics as st, sys
reps = range(1, int(sys.argv[1]) + 1)
for pol in ["recompute", "hilore"]:
    base = None
    for v in ["plain", "shared"]:
        upd, wall, cpu = [], [], []
        for r in reps:
            m = [json.loads(l) for l in open(f"m-{pol}-{v}-{r}.jsonl")]
            upd.append(sum(x["update_seconds"] for x in m[2:]))
            w, u, s = map(float, open(f"t-{pol}-{v}-{r}.txt").read().split()[-3:])
            wall.append(w); cpu.append(u + s)
        acc = json.load(open(f"s-{pol}-{v}-1.json"))["heldout_accuracy_after"]
        med = st.median(upd)
        base = base or med
        print(f"{pol:9} {v:6}: actor update {[round(x, 3) for x in upd]} s, median {med:.3f} s"
              f" ({base / med:.2f}x unshared); process wall {st.median(wall):.2f} s,"
              f" CPU {st.median(cpu):.2f} s; held-out accuracy {acc}")
PY
