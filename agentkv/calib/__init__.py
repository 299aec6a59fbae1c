"""`agentkv calibrate`: black-box probes of a running engine, fitted to the step-time cost model."""
