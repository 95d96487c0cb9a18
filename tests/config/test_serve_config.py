"""torchrun's flag values as `ftd serve` parses them (ftd.config.serve), and exits described."""

from __future__ import annotations

import pytest

from ftd.config.serve import parse_nnodes, parse_rdzv_conf, parse_std
from ftd.status.model import describe_exit


def test_torchrun_value_parsers() -> None:
    assert parse_nnodes("2:4") == (2, 4) and parse_nnodes("3") == (3, 3)
    with pytest.raises(ValueError):
        parse_nnodes("a:b")
    assert parse_rdzv_conf("is_host=1,timeout=5") == {"is_host": "1", "timeout": "5"}
    assert parse_std("3") == 3 and parse_std("0:1,1:2") == {0: 1, 1: 2}
    assert describe_exit(-9) == "signal SIGKILL (9)" and describe_exit(2) == "exit code 2"
