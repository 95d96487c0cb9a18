"""A --preload module that starts a thread: the zygote must refuse to fork."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
