#!/usr/bin/env python3
# tests/cli/check_bench.py — runs one `epcomm bench` command line (everything after `--`) and checks its JSON
# lines (every documented field present, verified true, the baseline measured or null) and its --plot SVG
# (well-formed XML, one panel per op and order, each with the three series and one point per token count).
import argparse
import json
import subprocess
import sys
import xml.etree.ElementTree as ET

FIELDS = [
    "op", "order", "ranks", "tokens", "hidden", "topk", "experts", "expert_alignment", "dtype", "quant", "cached",
    "launcher", "bind", "threads", "iters", "warmup", "rows", "row_bytes", "bytes", "bytes_bf16_equiv",
    "time_us_median", "time_us_min", "time_us_p99", "time_us_max", "gbps", "gbps_bf16_equiv", "memcpy_gbps",
    "ratio_to_memcpy", "baseline_time_us_median", "baseline_gbps", "speedup_vs_baseline", "baseline_verified",
    "verified", "combine_input", "segment_bytes", "first_iter_us", "first_iter_ratio", "peak_rss_mb", "peak_rss_mb_per_rank",
    "nodes", "network_bytes", "network_gbps", "link_gbps", "ratio_to_link", "combine_shared_tokens",
    "timing", "rank_time_us_median", "start_skew_us_median",
]
NETWORK = ["network_bytes", "network_gbps", "link_gbps", "ratio_to_link"]
BASELINE = ["baseline_time_us_median", "baseline_gbps", "speedup_vs_baseline", "baseline_verified"]
SVG = "{http://www.w3.org/2000/svg}"


def fail(msg, out="", err=""):
    sys.exit(f"check_bench: {msg}\n--- stdout:\n{out}\n--- stderr:\n{err}")


def check_lines(args, out, err):
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    if len(lines) != args.lines:
        fail(f"{len(lines)} JSON lines, expected {args.lines}", out, err)
    for j in lines:
        missing = [f for f in FIELDS if f not in j]
        if missing:
            fail(f"line without {missing}: {j}", out, err)
        if j["verified"] is not True:
            fail(f"verified is not true: {j}", out, err)
        if j["cached"] is not args.cached:
            fail(f"cached is {j['cached']}, expected {args.cached}: {j}", out, err)
        if j["memcpy_gbps"] <= 0 or j["gbps"] <= 0 or j["segment_bytes"] <= 0 or j["peak_rss_mb"] <= 0:
            fail(f"a rate, the segment or the peak RSS is not positive: {j}", out, err)
        if len(j["peak_rss_mb_per_rank"]) != j["ranks"] or max(j["peak_rss_mb_per_rank"]) != j["peak_rss_mb"]:
            fail(f"peak_rss_mb_per_rank does not have one value per rank with peak_rss_mb as its max: {j}", out, err)
        if not 0 <= j["combine_shared_tokens"] <= j["tokens"] * j["ranks"]:
            fail(f"combine_shared_tokens outside [0, tokens x ranks]: {j}", out, err)
        # Every rank of these tests shares the host: each iteration runs from the last call to the last return,
        # which no rank's own time can undercut (0.1: the one-decimal rounding of both).
        if j["timing"] != "span" or j["start_skew_us_median"] < 0:
            fail(f"timing is not span, or a negative start skew: {j}", out, err)
        if not 0 < j["time_us_median"] <= j["rank_time_us_median"] + 0.1:
            fail(f"time_us_median not in (0, rank_time_us_median]: {j}", out, err)
        if abs(j["ratio_to_memcpy"] - j["gbps"] / j["memcpy_gbps"]) > 0.0015 + 0.002 * j["ratio_to_memcpy"]:
            fail(f"ratio_to_memcpy != gbps / memcpy_gbps: {j}", out, err)
        if args.nodes > 1:
            if j["nodes"] != args.nodes or not all(j[f] is not None and j[f] > 0 for f in NETWORK):
                fail(f"expected {args.nodes} nodes with positive network fields: {j}", out, err)
            if abs(j["ratio_to_link"] - j["network_gbps"] / j["link_gbps"]) > 0.0015 + 0.002 * j["ratio_to_link"]:
                fail(f"ratio_to_link != network_gbps / link_gbps: {j}", out, err)
        elif j["nodes"] != 1 or any(j[f] is not None for f in NETWORK):
            fail(f"one node: nodes must be 1 and the network fields null: {j}", out, err)
        if args.baseline:
            if not (j["baseline_gbps"] > 0 and j["speedup_vs_baseline"] > 0 and j["baseline_verified"] is True):
                fail(f"baseline not measured, or not verified: {j}", out, err)
        elif any(j[f] is not None for f in BASELINE):
            fail(f"baseline fields should be null without MPI: {j}", out, err)
    return lines


def check_plot(path, lines):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        fail(f"--plot {path}: not a readable XML file: {e}")
    if root.tag != SVG + "svg":
        fail(f"--plot {path}: the root element is {root.tag}, not svg")
    panels = [g for g in root.iter(SVG + "g") if g.get("class") == "panel"]
    expected = {f"{j['op']}, {j['order']}" for j in lines}
    if {p.get("data-panel") for p in panels} != expected:
        fail(f"--plot {path}: panels {[p.get('data-panel') for p in panels]}, expected {sorted(expected)}")
    for p in panels:
        op, order = p.get("data-panel").split(", ")
        n = len({j["tokens"] for j in lines if j["op"] == op and j["order"] == order and j["tokens"] > 0})
        series = {g.get("data-series"): g for g in p.iter(SVG + "g") if g.get("class") == "series"}
        want = ["epcomm", "memcpy"] + (["baseline"] if lines[0]["baseline_gbps"] is not None else [])
        for name in want:
            g = series.get(name)
            if g is None:
                fail(f"--plot {path}: panel {p.get('data-panel')} has no series {name}")
            if len(g.findall(SVG + "circle")) != n or (n > 1 and g.find(SVG + "polyline") is None):
                fail(f"--plot {path}: panel {p.get('data-panel')} series {name}: not {n} points on a line")
        texts = "".join(t.text or "" for t in p.iter(SVG + "text"))
        if "tokens per rank" not in texts or "GB/s" not in texts:
            fail(f"--plot {path}: panel {p.get('data-panel')} lacks its axis labels")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, required=True, help="JSON lines expected")
    ap.add_argument("--baseline", action="store_true", help="expect the MPI baseline measured and verified")
    ap.add_argument("--plot", help="the --plot file the command writes")
    ap.add_argument("--cached", action="store_true", help="expect cached dispatch lines (bench --cached)")
    ap.add_argument("--nodes", type=int, default=1, help="nodes the run spans (network fields then required)")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        fail(f"'{' '.join(cmd)}' ran longer than {args.timeout} s")
    if res.returncode != 0:
        fail(f"'{' '.join(cmd)}' exited with {res.returncode}", res.stdout, res.stderr)
    lines = check_lines(args, res.stdout, res.stderr)
    if args.plot:
        check_plot(args.plot, lines)
    print(f"check_bench: {len(lines)} lines OK" + (f", {args.plot} OK" if args.plot else ""))


if __name__ == "__main__":
    main()
