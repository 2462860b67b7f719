"""The engine in virtual time: step-cost models of GPUs, synthetic models of stated strength, `bench simulate`."""
