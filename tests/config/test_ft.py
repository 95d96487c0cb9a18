"""ft_launcher's parameters (ftd.config.ft): section timeouts, names, the file and CLI merged."""

from __future__ import annotations

import pytest

from ftd.config.ft import (
    FaultToleranceConfig,
    UnknownParameter,
    check_parameter_name,
    merge_parameters,
    parse_section_timeouts,
)


def test_ft_parameters() -> None:
    assert parse_section_timeouts("setup:600, step:180,checkpointing:None") == {
        "setup": 600.0,
        "step": 180.0,
        "checkpointing": None,
    }
    assert check_parameter_name("rank-heartbeat-timeout") == "rank_heartbeat_timeout"
    with pytest.raises(UnknownParameter, match="did you mean 'safety_factor'"):
        check_parameter_name("safety_facter")
    fields, delegated, ignored = merge_parameters(
        {"rank_heartbeat_timeout": 5, "enable_nic_monitor": True, "restart_policy": "min-healthy"},
        {"rank_heartbeat_timeout": "None"},
    )
    config = FaultToleranceConfig.model_validate(fields)
    assert config.rank_heartbeat_timeout is None  # CLI overrides the file
    assert delegated == {"restart_policy": "min-healthy"} and ignored == ["enable_nic_monitor"]
    assert FaultToleranceConfig(rank_termination_signal="term").rank_termination_signal == "SIGTERM"
