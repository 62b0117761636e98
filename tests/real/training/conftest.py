def pytest_configure(config):
    config.addinivalue_line("markers", "real: runs against the real stack (megatron-core, slime, SGLang)")
