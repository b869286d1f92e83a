import hashlib
import re

import pytest


@pytest.fixture
def ns(cluster, request: pytest.FixtureRequest) -> str:
    """A namespace of its own for each live test, named after it, in the module's `cluster`."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_")).strip("-")
    return cluster.namespace(f"{slug[:40]}-{hashlib.sha1(request.node.name.encode()).hexdigest()[:6]}")
