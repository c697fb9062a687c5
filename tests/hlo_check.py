"""Finds `V x D` arrays in a compiled XLA module: which instructions produce them, and how."""

import re


def _computations(hlo_text: str) -> dict[str, list[str]]:
  """Maps each computation's name to its instruction lines; the entry is under 'ENTRY'."""
  computations: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header and not line.startswith(" "):
      current = "ENTRY" if header.group(1) else header.group(2)
      computations[current] = []
    elif current is not None and line.strip() and line.strip() != "}":
      computations[current].append(line.strip())
  return computations


def table_shaped_values(hlo_text: str, shape: str) -> list[tuple[str, str]]:
  """`(opcode, detail)` of every entry instruction whose result has `shape`, e.g. 'f32[1000,8]'.

  For a fusion, `detail` is the opcode of its fused root (a wrapped scatter fuses
  to 'scatter'); for a custom call that writes into one of its operands (the CPU
  kernels), 'in-place custom-call'; otherwise it is the opcode again.
  """
  computations = _computations(hlo_text)
  pattern = re.compile(r"=\s*" + re.escape(shape) + r"\{[^}]*\}\s+([\w\-]+)\(")
  values = []
  for line in computations["ENTRY"]:
    match = pattern.search(line)
    if not match:
      continue
    opcode = match.group(1)
    detail = opcode
    if opcode == "fusion":
      called = re.search(r"calls=%([\w.\-]+)", line).group(1)
      root = next(x for x in computations[called] if x.startswith("ROOT"))
      detail = re.search(r"=\s*\S+\s+([\w\-]+)\(", root).group(1)
    elif opcode == "custom-call" and "output_to_operand_aliasing" in line:
      detail = "in-place custom-call"
    values.append((opcode, detail))
  return values


def dense_table_temporaries(compiled, shape: str, num_donated: int) -> list[str]:
  """Problems with `shape`-d arrays in a compiled step; empty when there is no V x D temporary.

  Allowed: `num_donated` parameters (the table and its moments), scatters into
  them (the row updates, and the step's scratch marks in the first moment), the
  CPU kernels' custom calls that write into their operand, bitcasts and tuple
  plumbing. Also checked: the donated buffers alias outputs,
  and XLA's temporary allocation is smaller than one table, so every scatter
  updates a donated buffer in place rather than a copy of it.
  """
  text = compiled.as_text()
  values = table_shaped_values(text, shape)
  problems = []
  parameters = [v for v in values if v[0] == "parameter"]
  if len(parameters) != num_donated:
    problems.append(f"{len(parameters)} {shape} parameters, expected {num_donated}")
  plumbing = {"parameter", "bitcast", "get-tuple-element", "tuple"}
  writes = [v for v in values if v[0] not in plumbing]
  others = [v for v in writes if v[1] not in ("scatter", "in-place custom-call")]
  if others:
    problems.append(f"{shape} values that are not scatters into a donated buffer: {others}")
  if "input_output_alias" not in text:
    problems.append("no input_output_alias: the buffers were not donated")
  rows, cols = (int(d) for d in re.findall(r"\d+", shape.split("[")[1]))
  table_bytes = rows * cols * 4
  temp = compiled.memory_analysis().temp_size_in_bytes
  if temp >= table_bytes:
    problems.append(f"temporary allocation of {temp} bytes >= one table ({table_bytes})")
  return problems
