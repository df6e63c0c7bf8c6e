"""Runtime: the program Dynamo calls on every call, its gate, calls that bypass the compiled module."""
