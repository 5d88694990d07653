"""The benchmarks: each prints its figures (ratios measured side by side in one run), none is a test.

    python -m jobs.bench.compaction  layouts and strategies on one in-process engine (`make bench`)
    python -m jobs.bench.agent       an agent loop through /v1/chat/completions: none, blocking, background
    python -m jobs.bench.yielding    an agent's turns beside a cold compaction, per engine scheduling rule
    python -m jobs.bench.history     one ~20k-token coding-agent session compacted on the 8k window
    python -m jobs.bench.planning    what planning one compaction costs (time, memory)
    python -m jobs.bench.affinity    the placement policies on two replicas
    python -m jobs.bench.load        N concurrent agent sessions (`make load`; also a Ray job)
    python -m jobs.bench.soak        the service under mixed traffic with replicas and coordinators killed

`common` holds what they share: progress lines, the table, the local service with its cache reset.
"""
