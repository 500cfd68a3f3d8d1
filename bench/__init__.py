"""SpecPilot benchmark harness: real-text workloads, Poisson or closed-loop load against
an engine host's OpenAI API, mode switching through its control API, and reports.

Modules:
    workloads       prompt sources (HumanEval, stdlib docstrings, Zen of Python) and the shift workload
    loadgen         async httpx streaming clients: Poisson arrivals or fixed concurrency
    metrics         percentiles, throughput, goodput, acceptance from counters
    engine_control  mode strings -> PUT /control/config, state sampling, /metrics counters
    runner          one benchmark cell (mode x workload x load) -> a JSON-able result
    report          summary tables (Markdown/CSV/JSON) with target ratios, Plotly charts
    __main__        ``python -m bench run | matrix | workloads``
"""
