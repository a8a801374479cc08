import subprocess, sys, json, os, statistics
sys.path.insert(0, "/work/main/bench")
import cpu_orchestration as co
res = {}
for rep in range(4):
    for thr in ("def", "1"):
        env = dict(os.environ)
        if thr == "1": env["OPENBLAS_NUM_THREADS"] = "1"
        for v in ("real", "noop"):
            p = subprocess.run([sys.executable, "-c", co.CHILD, "-", v, "--prompt-tokens", "256", "--decode-tokens", "128"], capture_output=True, text=True, env=env)
            d = json.loads(p.stdout)
            res.setdefault((thr, v), []).append((d["time_per_layer_us"]["decode"], d["decode_cpu_s"]/d["decode_s"]))
for k, v in res.items(): print(k, "min", round(min(a for a,_ in v),1), "med", round(statistics.median(a for a,_ in v),1), "cpu/wall", round(statistics.median(b for _,b in v),2))
