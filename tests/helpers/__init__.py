"""What several test files share: helpers, not tests (pytest collects nothing here). A test module
imports from `helpers`, never from another test module (test_test_layout.py checks it),
so running one test file never imports, and re-runs the collection of, another.

    cli          the CLI in a subprocess: train_cli / export_cli (and the metrics they return), tool_demo_cli
    checkpoints  an uninterrupted run and a stopped-then-resumed one, and the check that they agree
    packing      a tiny Qwen2, rows of different lengths, the Trainer's log-prob and loss paths without DeepSpeed
    memory       FakeTrainer: records the hand-off's offload and reload calls
    plan         the planner's inputs: an H100's and a node's bytes, shapes and GPU configs of shipped models
    kernels      kernel inputs and the fused-vs-reference comparison (tests/kernels/)

The tests' root (this package's parent) is on sys.path: pytest puts conftest.py's directory there.
"""
