"""`--kv-transfer-config`: a mistake is one line and exit status 2, before any rank starts."""

from __future__ import annotations

import pytest

from kvshard.config import ConfigError
from kvshard.disagg.config import KVTransferConfig
from kvshard.entrypoints.cli import main


def test_a_producer_config_reads_vllm_s_field_names():
    config = KVTransferConfig.from_json('{"kv_role": "kv_producer", "kv_port": 14579, '
                                        '"kv_connector_extra_config": {"hold_timeout_s": 2.5}}')
    assert config.is_producer and config.kv_port == 14579 and config.hold_timeout_s == 2.5
    assert config.transfer_timeout_s == 30.0


@pytest.mark.parametrize("text, says", [
    ("{kv_role", "not valid JSON"),
    ('["kv_producer"]', "must be a JSON object"),
    ('{"kv_role": "kv_both"}', "kv_role must be one of"),
    ('{"kv_role": "kv_consumer", "kv_rank": 1}', "unknown field"),
    ('{"kv_role": "kv_consumer", "kv_connector": "NixlConnector"}', "is not available"),
    ('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"transfer_timeout_s": 0}}', "seconds > 0"),
    ('{"kv_role": "kv_producer", "kv_port": 70000}', "not a TCP port"),
    ('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"producers": ["http://127.0.0.1:8100"]}}',
     "producers must map producer engine ids"),
    ('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"producers": {"p": "127.0.0.1:8100"}}}',
     "producers must map producer engine ids"),
    ('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"shared_secret": "short"}}', "at least 16"),
    ('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"hold_timeout": 5}}', "unknown kv_connector_extra"),
    ('{"kv_role": "kv_consumer", "engine_id": "a b/c"}', "engine_id must be"),
])
def test_a_bad_config_says_what_to_change(text: str, says: str):
    with pytest.raises(ConfigError, match=says):
        KVTransferConfig.from_json(text)


def test_a_consumer_lists_the_producers_it_may_pull_from_and_the_secret():
    config = KVTransferConfig.from_json('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"producers": '
                                        '{"prefill-0": "http://127.0.0.1:8100/"}, "shared_secret": "0123456789abcdef"}}')
    assert config.producers == {"prefill-0": "http://127.0.0.1:8100"}
    assert config.shared_secret == "0123456789abcdef"


def test_the_deployment_secret_comes_from_the_environment_or_one_generated_file(tmp_path, monkeypatch):
    from kvshard.disagg.secret import deployment_secret, secret_file

    monkeypatch.setenv("KVSHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSHARD_KV_TRANSFER_SECRET", raising=False)
    generated = deployment_secret()
    assert len(generated) == 64 and deployment_secret() == generated  # made once, then read by everyone
    assert secret_file().stat().st_mode & 0o077 == 0  # readable by its owner only
    assert deployment_secret("configured-secret-123") == "configured-secret-123"
    monkeypatch.setenv("KVSHARD_KV_TRANSFER_SECRET", "from-the-environment")
    assert deployment_secret() == "from-the-environment"


def test_serve_refuses_a_bad_role_before_starting(capsys):
    assert main(["serve", "--kv-transfer-config", '{"kv_role": "decode"}']) == 2
    assert "kv_role must be one of" in capsys.readouterr().err


def test_proxy_refuses_a_url_that_is_not_one(capsys):
    assert main(["proxy", "--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"]) == 2
    assert "is not a server URL" in capsys.readouterr().err


def test_offline_llm_refuses_a_kv_transfer_config():
    from kvshard import LLM

    with pytest.raises(ConfigError, match="needs a server"):
        LLM(kv_transfer_config='{"kv_role": "kv_producer"}')
