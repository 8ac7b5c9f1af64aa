raise RuntimeError("this module must never be imported: its env is missing")
