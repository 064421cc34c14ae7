"""Bearer key -> tenant, and request `model` -> base, current adapter or an explicit version."""

import pytest

from serving.auth import Authenticator, ModelChoice, resolve_model
from serving.errors import ModelNotFound, Unauthenticated

pytestmark = pytest.mark.unit

KEYS = [("acme", "acme-secret-1"), ("globex", "globex-secret-2")]


@pytest.mark.parametrize(
    ("header", "tenant"),
    [("Bearer acme-secret-1", "acme"), ("bearer globex-secret-2", "globex"), ("Bearer  acme-secret-1 ", "acme")],
)
def test_key_decides_the_tenant(header, tenant):
    assert Authenticator(KEYS).tenant(header) == tenant


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic acme-secret-1", "Bearer nope", "acme-secret-1"])
def test_missing_or_unknown_key_is_401(header):
    with pytest.raises(Unauthenticated) as e:
        Authenticator(KEYS).tenant(header)
    assert e.value.status == 401
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def resolve(model, tenant="acme"):
    return resolve_model(model, tenant=tenant, base_name="base")


def test_model_names():
    assert resolve("base") == ModelChoice("acme", adapter=False)
    assert resolve("acme") == ModelChoice("acme", adapter=True, version=None)
    assert resolve("acme@3") == ModelChoice("acme", adapter=True, version=3)
    assert resolve("globex", tenant="globex") == ModelChoice("globex", adapter=True)


@pytest.mark.parametrize("model", ["globex", "globex@1", "globex@999"])
def test_another_tenants_adapter_is_the_same_404_as_a_name_no_tenant_has(model):
    """A 403 "belongs to another tenant" told any key which other tenants exist."""
    with pytest.raises(ModelNotFound) as e:
        resolve(model)
    with pytest.raises(ModelNotFound) as unknown:
        resolve(model.replace("globex", "nosuch"))
    assert e.value.status == 404
    assert e.value.body() == {"error": {**unknown.value.body()["error"],
                                        "message": unknown.value.message.replace("nosuch", "globex")}}


@pytest.mark.parametrize("model", ["nope", "nope@1", "acme@0", "acme@x", "acme@", "acme@-1", "base@1", "acme@²",
                                   "acme@01", "acme@" + "9" * 30])
def test_unknown_models_and_versions_are_404(model):
    with pytest.raises(ModelNotFound) as e:
        resolve(model)
    body = e.value.body()
    assert e.value.status == 404
    assert body == {"error": {"message": e.value.message, "type": "invalid_request_error", "param": None,
                              "code": "model_not_found"}}
