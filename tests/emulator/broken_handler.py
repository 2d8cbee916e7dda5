"""A handler module that fails on import: the emulator must report Runtime.ImportModuleError."""

raise RuntimeError("this module is broken on purpose")
