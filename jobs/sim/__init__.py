"""A discrete-event simulator of the deployment: replicas as vLLM-like engines, the coordinator's placement, agents.

Stages, one module each: `profiles` (engine speed and memory figures, YAML with cited sources), `cache` (a replica's
prefix cache), `engine` (one replica: chunked prefill and batched decode as a fluid model), `shapes` (compaction
prompts in token counts), `cluster` (replicas, placement via `serving.routing`, compaction admission), `workload`
(agent sessions), `metrics` (one result row per run), `calibrate` and `validate` (the real CPU engine), `report`.
"""
