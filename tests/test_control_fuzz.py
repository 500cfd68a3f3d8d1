"""Bounded schemathesis run of the engine host's ``/control/*`` routes against the
OpenAPI schema the real engine host serves: no request may get a 5xx. It exercises
whatever the schema declares (request bodies included where declared, with schemathesis'
positive and negative generation); the engine's config is put back afterwards."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

pytestmark = pytest.mark.engine

#: Examples per operation: bounded so that the run takes well under a minute on CPU.
MAX_EXAMPLES = 40


def test_control_routes_never_answer_5xx(engine_host, capsys):
    paths = httpx.get(engine_host.url + "/openapi.json", timeout=30).json()["paths"]
    assert {"/control/state", "/control/config"} <= set(paths)
    schema = schemathesis.openapi.from_url(engine_host.url + "/openapi.json").include(path_regex=r"^/control/")
    seen: dict[str, int] = {}
    failures: list[str] = []
    with httpx.Client(base_url=engine_host.url, headers=engine_host.control_headers, timeout=60) as c:
        before = c.get("/control/state").json()["config"]
        try:
            for result in schema.get_all_operations():
                op = result.ok()

                @given(case=op.as_strategy())
                @settings(
                    max_examples=MAX_EXAMPLES,
                    deadline=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck),
                    database=None,
                )
                def run(case):
                    response = case.call(base_url=engine_host.url, headers=engine_host.control_headers, timeout=60)
                    key = f"{case.method} {case.path}" + (" with body" if _has_body(case) else "")
                    seen[key] = seen.get(key, 0) + 1
                    if response.status_code >= 500:
                        failures.append(
                            f"{case.method} {case.path} -> {response.status_code}: "
                            f"{response.text[:200]} (body {case.body!r:.200}, query {case.query!r})"
                        )

                run()
        finally:
            c.put("/control/config", json=before).raise_for_status()
    with capsys.disabled():
        print(
            f"\nschemathesis: requests per operation {seen}; PUT /control/config declares a request body: "
            f"{'requestBody' in paths['/control/config'].get('put', {})}"
        )
    assert sum(seen.values()) > 0
    assert not failures, "\n".join(failures[:10])


def _has_body(case) -> bool:
    return case.body is not None and type(case.body).__name__ != "NotSet"
