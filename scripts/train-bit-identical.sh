#!/usr/bin/env bash
# Are two hilore binaries' trainings the same? For the exact policies (store, recompute,
# compress-bf16), `hilore train --seed 3 --steps 20` under each binary; every per-step
# metric except times and throughputs must be equal, and the held-out accuracies.
#
#   scripts/train-bit-identical.sh OLD_BINARY NEW_BINARY [WORK_DIR]
#
# Used to hold a restructure to "changes no result": build the commit before it and the
# one after (e.g. in a git worktree sharing this target directory), then run this.
set -euo pipefail
old=$(realpath "$1"); new=$(realpath "$2"); dir=${3:-$(mktemp -d)}
mkdir -p "$dir"; cd "$dir"
status=0
for pol in store recompute compress-bf16; do
  for v in old new; do
    bin=$old; [ "$v" = new ] && bin=$new
    "$bin" train --policy "$pol" --seed 3 --steps 20 --no-progress --force \
      --checkpoint "bc-$v-$pol.ckpt" --metrics "bc-$v-$pol.jsonl" \
      --summary "bc-$v-$pol.json" > "bc-$v-$pol.out"
  done
  python3 - "$pol" <<'PY' || status=1
import json, sys
pol = sys.argv[1]
timed = lambda k: any(w in k for w in ("seconds", "tok_s", "tokens_per_s", "time"))
def rows(v):
    return [{k: x for k, x in json.loads(l).items() if not timed(k)}
            for l in open(f"bc-{v}-{pol}.jsonl")]
a, b = rows("old"), rows("new")
keys = sorted(set(a[0]) & set(b[0]))
same = len(a) == len(b) and all(
    json.dumps([r[k] for k in keys]) == json.dumps([s[k] for k in keys]) for r, s in zip(a, b))
sa, sb = (json.load(open(f"bc-{v}-{pol}.json")) for v in ("old", "new"))
acc = [k for k in ("heldout_accuracy_before", "heldout_accuracy_after",
                   "heldout_greedy_accuracy_after") if sa[k] != sb[k]]
ok = same and not acc
print(f"{pol}: {len(a)} steps, {len(keys)} fields per step, "
      f"{'bit-identical' if ok else 'DIFFERENT'}; held-out accuracy after {sb['heldout_accuracy_after']}"
      + (f"; fields on one side only: {sorted(set(a[0]) ^ set(b[0]))}" if set(a[0]) ^ set(b[0]) else ""))
sys.exit(0 if ok else 1)
PY
done
exit $status
