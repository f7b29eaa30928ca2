"""DSec in ten lines: start the daemon with `dsec up`, then run `python examples/quickstart.py`."""

import dsec

with dsec.Sandbox.create(image="debian-python", cpu=1, memory="512Mi", timeout=600) as sb:
    sb.files.write("/workspace/hello.py", "print('hello from', __import__('platform').node())\n")
    result = sb.exec("python3 hello.py", timeout=30)
    print(result.exit_code, result.stdout.decode(), end="")
    for event in sb.exec_stream("for i in 1 2 3; do echo tick $i; sleep 0.2; done"):
        if event.type == "stdout":
            print((event.data or b"").decode(), end="")
