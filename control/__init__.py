"""SpecPilot control plane: owns all state and every decision the dashboard shows.

Modules (each public function takes the :class:`control.store.Store` first and, where it
concerns one engine host, the host's name):

    db             engines, URLs, Alembic migrations (schema only through migrations/)
    models         the tables as typed SQLAlchemy models
    store          the Store (sessions), engine hosts, the audit trail
    versions       config versions: history, diff, outcomes, the per-host apply lease
    apply          apply / rollback / re-apply after a restart (validate, pending, send, outcome)
    client         HTTP client of an engine host (timeouts, retries on reads only)
    metrics_parse  /metrics through prometheus-client's parser; histogram quantiles
    sampling       scrapes -> 1 s samples (windowed percentiles, acceptance); roll-ups
    samples        samples in the store: chart series, downsampling, retention, gaps
    collector      the daemon: scrape, store, alerts, gaps, restart detection, drift checks
    drift          config drift between an engine and the store: detection, re-apply, adopt
    alerts         alert rules as data, their evaluation, alert events
    cost           cost model and weekly report (data and CSV)
    fleet          fleet-wide status and aggregated series
    warmup         warm-up schedules and runs
    cli, up        python -m control, and its 'up' main job (supervises the engine host, dashboard)
    cli_drift      python -m control config drift|reapply|adopt
    testing        throwaway PostgreSQL, stand-in engine host, TCP relay (tests, benchmarks)
"""
