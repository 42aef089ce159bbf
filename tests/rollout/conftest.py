def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA and the `gpu` extra (pip install -e .[gpu])")
