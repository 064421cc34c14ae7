"""ingest.process: the ingest section of the config reaches the objects `build` makes (no broker needed)."""

import pytest
from pydantic import ValidationError

from clora.config import Config, IngestConfig
from ingest.metrics import IngestMetrics
from ingest.process import build

pytestmark = pytest.mark.unit


def test_the_caps_reach_the_processor_and_the_store_view(tmp_path):
    cfg = Config(data_dir=tmp_path, ingest=IngestConfig(max_pending_feedback_per_tenant=7, max_pending_feedback=20,
                                                               max_auto_tenants=3))
    ingest = build(cfg, metrics=IngestMetrics())
    assert ingest.processor.max_auto_tenants == 3
    assert ingest.max_pending_per_tenant == 7
    ingest.load_store()
    assert (ingest.store.pending.cap, ingest.store.pending.total) == (7, 20)


@pytest.mark.parametrize("field", ["max_pending_feedback_per_tenant", "max_pending_feedback", "max_auto_tenants"])
def test_the_caps_are_at_least_one(field):
    with pytest.raises(ValidationError, match=field):
        IngestConfig(**{field: 0})
