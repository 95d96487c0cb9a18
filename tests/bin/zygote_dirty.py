"""A --preload module that leaves state a rank must not inherit: handlers, faulthandler, env."""

import faulthandler
import os
import signal
import sys

signal.signal(signal.SIGUSR1, lambda *_: None)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(99))
faulthandler.enable()
os.environ["FTD_TEST_DIRTY"] = "1"
