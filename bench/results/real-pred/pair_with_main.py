"""Merge the predictor artifact's quality rows (whole examples), pair them by seed with the main
artifact's pc-test-1024.jsonl: same examples, same schedules (s1 = s7, s2 = s11)."""
import json, random, collections, sys
rows = [json.loads(l) for l in open(f"bench/results/real-pred/pc-pred-test-1024.jsonl") if l.strip()]
rows = [r for r in rows if r.get("kind") == "task"]
by = collections.defaultdict(dict)
for r in rows: by[r["seed"]][r["mode"]] = r
modes = {"oracle", "naive", "scd:s1", "scd:s2"}
whole = sorted(s for s, v in by.items() if set(v) == modes)
with open("/dev/null", "w") as f:
    for s in whole:
        for m in ("oracle", "naive", "scd:s1", "scd:s2"): f.write(json.dumps(by[s][m]) + "\n")
old = collections.defaultdict(dict)
for l in open("bench/results/real/pc-test-1024.jsonl"):
    r = json.loads(l)
    if r.get("kind") == "task": old[r["seed"]][r["mode"]] = r
n = len(whole)
same_oracle = sum(by[s]["oracle"]["prediction"] == old[s]["oracle"]["prediction"] for s in whole)
same_naive = sum(by[s]["naive"]["prediction"] == old[s]["naive"]["prediction"] for s in whole)
print(f"n = {n} examples (seeds {whole[0]}..{whole[-1]}); oracle answers equal the main file's on {same_oracle}, naive on {same_naive}")
def mean(xs): return sum(xs) / len(xs)
def ci(d, B=4000):
    rng = random.Random(0); m = []
    for _ in range(B):
        m.append(mean([d[rng.randrange(len(d))] for _ in d]))
    m.sort(); return m[int(0.025 * B)], m[int(0.975 * B)]
o = [by[s]["oracle"]["f1"] for s in whole]
for new, ref in (("naive", "naive"), ("scd:s1", "scd:s7"), ("scd:s2", "scd:s11")):
    a = [by[s][new]["f1"] for s in whole]; b = [old[s][ref]["f1"] for s in whole]
    gap_new = [x - y for x, y in zip(o, a)]; gap_old = [x - y for x, y in zip(o, b)]
    d = [x - y for x, y in zip(a, b)]
    lo, hi = ci(d); glo, ghi = ci(gap_new)
    print(f"{new:8s} F1 {100*mean(a):.1f} gap {100*mean(gap_new):+.1f} [{100*glo:+.1f},{100*ghi:+.1f}] | main artifact's {ref}: F1 {100*mean(b):.1f} gap {100*mean(gap_old):+.1f} | new - main {100*mean(d):+.1f} [{100*lo:+.1f},{100*hi:+.1f}]")
print(f"oracle F1 {100*mean(o):.1f}")
