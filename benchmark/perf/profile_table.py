"""Print the shipped step-time profiles: KV capacity and the step time of reference batches.

    PYTHONPATH=vllm-mars python benchmark/perf/profile_table.py

Pure arithmetic over the profile files (no engine); the numbers in docs/sim-profiles.md come from here.
"""

from __future__ import annotations

from vllm_mars.sim.profile import available_profiles, load_profile


def main() -> None:
    print("| profile | weights GiB | KV B/token | KV capacity (tokens) | max_model_len | prefill 8192 @ 32k ctx (s) "
          "| decode 64 x 32k ctx (s) | decode 1 x 1k ctx (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in available_profiles():
        p = load_profile(name)
        print(f"| {name} | {p.shape.weight_bytes / 2**30:.1f} | {p.kv_bytes_per_token()} | {p.kv_capacity_tokens():,} "
              f"| {p.max_model_len:,} | {p.step_seconds([(8192, 32768)], []):.3f} "
              f"| {p.step_seconds([], [32768] * 64):.4f} | {p.step_seconds([], [1024]):.4f} |")


if __name__ == "__main__":
    main()
