"""A simulated vLLM worker for ``engine = "sim"`` (``python -m pdctl.sim``); see docs/simulator.md.

* ``__main__``      -- vLLM-style flags -> ``EngineConfig``; starts uvicorn; faults at start/stop
* ``server``        -- raw ASGI app: vLLM's endpoints, JSON and SSE shapes, errors
* ``engine``        -- continuous-batching scheduler and step loop; request and config types
* ``prefix_cache``  -- the engine's prefix cache: block hash chain, LRU, its KV events
* ``kv_events``     -- ``--kv-events-config`` and the ZMQ publisher of those events (vLLM's ZmqEventPublisher)
* ``connector``     -- the engine's KV connector: NIXL-like pulls and leases, or shared storage
* ``kv``            -- deterministic KV bytes, lease store, the TCP side channel, shared-storage files
* ``timing``        -- model shapes, hardware profiles, links and the step-time formulas
* ``faults``        -- ``--sim-fault`` parsing
* ``metrics``       -- vLLM's Prometheus metrics
* ``logfmt``        -- vLLM's log line format
* ``text``          -- toy tokenizer and chat template
"""
