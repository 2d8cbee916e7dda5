"""The Terraform module's security properties, read from the HCL itself (python-hcl2).

`terraform validate` needs the AWS provider, which cannot be downloaded here, so these tests
parse terraform/*.tf and check what matters: nothing admits the internet, SSH is closed unless
asked for, the ZeroMQ ports open only to the function and the servers, the bucket is private,
encrypted, versioned and TLS-only, the function runs in the VPC, IAM grants no wildcard action
and no "*" resource except where AWS offers nothing narrower. The servers' user data is
rendered and its launcher run against stubs, so that it keeps matching the `dorylus` CLI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dorylus.function import FUNCTION_NAME

hcl2 = pytest.importorskip("hcl2")

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "terraform"
EXAMPLE = MODULE / "examples"


def _unquote(value):
    """python-hcl2 keeps string literals' quotes ('"tcp"') and marks blocks; drop both."""
    if isinstance(value, str):
        if len(value) >= 2 and value[0] == value[-1] == '"':
            return value[1:-1].replace('\\"', '"')
        return value
    if isinstance(value, list):
        return [_unquote(v) for v in value]
    if isinstance(value, dict):
        return {_unquote(k): _unquote(v) for k, v in value.items() if k not in ("__is_block__", "__comments__")}
    return value


def load(directory: Path) -> dict:
    """Blocks of every .tf file in ``directory``: {"resource": {(type, name): body}, "data": ...,
    "variable": {name: body}, "output": {name: body}, "locals": {name: value}}."""
    merged: dict = {"resource": {}, "data": {}, "variable": {}, "output": {}, "locals": {}, "module": {}}
    for path in sorted(directory.glob("*.tf")):
        with open(path) as f:
            parsed = _unquote(hcl2.load(f))
        for kind in ("resource", "data"):
            for block in parsed.get(kind, []):
                for rtype, named in block.items():
                    for name, body in named.items():
                        merged[kind][(rtype, name)] = body
        for kind in ("variable", "output", "module"):
            for block in parsed.get(kind, []):
                merged[kind].update(block)
        for block in parsed.get("locals", []):
            merged["locals"].update(block)
    return merged


@pytest.fixture(scope="module")
def tf() -> dict:
    return load(MODULE)


def of_type(tf: dict, rtype: str, kind: str = "resource") -> dict:
    return {name: body for (t, name), body in tf[kind].items() if t == rtype}


def statements(document: dict) -> list[dict]:
    """A policy document's statements, including those of ``dynamic "statement"`` blocks."""
    found = list(document.get("statement", []))
    for dynamic in document.get("dynamic", []):
        if "statement" in dynamic:
            found += dynamic["statement"]["content"]
    return found


def test_nothing_admits_the_internet(tf):
    """0.0.0.0/0 (or ::/0) appears only as an egress destination and a default route."""
    allowed = {"aws_vpc_security_group_egress_rule", "aws_route"}
    for (rtype, name), body in tf["resource"].items():
        text = json.dumps(body)
        if "0.0.0.0/0" in text or "::/0" in text:
            assert rtype in allowed, f"{rtype}.{name} mentions the whole internet"
    for name, body in of_type(tf, "aws_security_group").items():
        assert "ingress" not in body and "egress" not in body, f"{name}: rules belong in separate resources"
    assert not of_type(tf, "aws_security_group_rule")
    for name, body in of_type(tf, "aws_vpc_security_group_ingress_rule").items():
        assert "cidr_ipv6" not in body and "prefix_list_id" not in body, name
    assert of_type(tf, "aws_default_security_group")["this"].keys() <= {"vpc_id", "tags"}  # no rules at all


def test_ssh_is_closed_by_default(tf):
    variable = tf["variable"]["ssh_cidr_blocks"]
    assert variable["default"] == []
    assert "0.0.0.0/0" in variable["validation"][0]["condition"]  # the whole internet is refused outright
    port_22 = {name: body for name, body in of_type(tf, "aws_vpc_security_group_ingress_rule").items()
               if body.get("from_port") == 22 or body.get("to_port") == 22}
    assert list(port_22) == ["ssh"]
    assert port_22["ssh"]["for_each"] == "${toset(var.ssh_cidr_blocks)}"  # zero rules for an empty list
    assert port_22["ssh"]["cidr_ipv4"] == "${each.value}"
    for body in of_type(tf, "aws_vpc_security_group_ingress_rule").values():
        assert (body.get("from_port"), body.get("to_port")) != (0, 65535) and body["ip_protocol"] == "tcp"


def test_zeromq_ports_open_only_to_the_function_and_the_servers(tf):
    function_sg, servers_sg = "${aws_security_group.function.id}", "${aws_security_group.servers.id}"
    zmq = tf["locals"]["zmq_ports"]
    assert {v["port"] for v in zmq.values()} == {"${var.graph_server_port}", "${var.param_server_port}"}
    rules = of_type(tf, "aws_vpc_security_group_ingress_rule")
    sources = set()
    for name, body in rules.items():
        if name == "ssh":
            continue
        assert body["for_each"] == "${local.zmq_ports}" and body["from_port"] == body["to_port"] == "${each.value.port}"
        assert "cidr_ipv4" not in body, f"{name}: a ZeroMQ port must not be opened to addresses"
        assert body["security_group_id"] == servers_sg
        sources.add(body["referenced_security_group_id"])
    assert sources == {function_sg, servers_sg}
    # The function listens on nothing.
    assert all(body["security_group_id"] != function_sg for body in rules.values())


def test_bucket_is_private_encrypted_versioned_and_tls_only(tf):
    bucket = "${aws_s3_bucket.this.id}"
    block = of_type(tf, "aws_s3_bucket_public_access_block")["this"]
    assert block["bucket"] == bucket
    assert all(block[k] is True for k in ("block_public_acls", "block_public_policy", "ignore_public_acls",
                                           "restrict_public_buckets"))
    sse = of_type(tf, "aws_s3_bucket_server_side_encryption_configuration")["this"]["rule"][0]
    default = sse["apply_server_side_encryption_by_default"][0]
    assert default == {"sse_algorithm": "aws:kms", "kms_master_key_id": "${aws_kms_key.this.arn}"}
    assert of_type(tf, "aws_kms_key")["this"]["enable_key_rotation"] is True
    versioning = of_type(tf, "aws_s3_bucket_versioning")["this"]
    assert versioning["versioning_configuration"][0]["status"] == "Enabled"
    assert of_type(tf, "aws_s3_bucket_ownership_controls")["this"]["rule"][0]["object_ownership"] == "BucketOwnerEnforced"
    assert not of_type(tf, "aws_s3_bucket_acl")
    assert of_type(tf, "aws_s3_bucket_policy")["this"]["policy"] == "${data.aws_iam_policy_document.bucket.json}"
    (deny,) = statements(of_type(tf, "aws_iam_policy_document", "data")["bucket"])
    assert deny["effect"] == "Deny" and deny["actions"] == ["s3:*"]
    assert deny["resources"] == ["${aws_s3_bucket.this.arn}", "${aws_s3_bucket.this.arn}/*"]
    assert deny["condition"][0] == {"test": "Bool", "variable": "aws:SecureTransport", "values": ["false"]}
    assert tf["variable"]["force_destroy_bucket"]["default"] is False


def test_function_runs_the_bundle_in_the_vpc(tf):
    function = of_type(tf, "aws_lambda_function")["tensor"]
    vpc = function["vpc_config"][0]
    assert vpc["subnet_ids"] == ["${aws_subnet.private.id}"]
    assert vpc["security_group_ids"] == ["${aws_security_group.function.id}"]
    assert function["filename"] == "${var.function_zip}"
    assert function["source_code_hash"] == "${filebase64sha256(var.function_zip)}"
    module, _, attr = function["handler"].rpartition(".")
    assert module == "lambdas.handler" and re.search(rf"^def {attr}\(", (REPO / "lambdas/handler.py").read_text(), re.M)
    assert function["runtime"] == "python${var.function_python}"
    assert function["architectures"] == ["${var.function_architecture}"]
    assert of_type(tf, "aws_subnet")["private"]["map_public_ip_on_launch"] is False
    # The private subnet's default route goes to the NAT gateway, never straight to the internet.
    routes = of_type(tf, "aws_route")
    assert routes["private_nat"]["route_table_id"] == "${aws_route_table.private.id}" and "gateway_id" not in routes["private_nat"]
    assert of_type(tf, "aws_vpc_endpoint")["s3"]["vpc_endpoint_type"] == "Gateway"
    # The servers' fixed addresses are reserved before the function's interfaces can take one.
    reservations = of_type(tf, "aws_ec2_subnet_cidr_reservation")
    assert {r["cidr_block"] for r in reservations.values()} == {"${local.param_server_block}", "${local.graph_server_block}"}
    assert all(r["reservation_type"] == "explicit" for r in reservations.values())
    for name in reservations:
        assert f"${{aws_ec2_subnet_cidr_reservation.{name}}}" in function["depends_on"]
    assert "local.param_server_block" in tf["locals"]["param_server_ips"]
    assert "local.graph_server_block" in tf["locals"]["graph_server_ips"]


def test_the_function_is_deployed_under_the_name_graph_servers_invoke_by_default(tf):
    assert tf["locals"]["function_name"] == "${var.name}-tensor"
    assert f"{tf['variable']['name']['default']}-tensor" == FUNCTION_NAME


def test_function_environment_holds_the_keys_dorylus_reads(tf):
    """The names Terraform gives the function's CURVE variables are the ones dorylus.curve reads,
    and the roles it accepts are the ones `dorylus keys` writes."""
    from dorylus import curve

    text = (MODULE / "function.tf").read_text()
    names = {template.replace("${upper(role)}", role.upper())
             for roles, template in re.findall(r'for role in \[([^\]]*)\]\s*:\s*"([^"]+)"', text)
             for role in re.findall(r'"(\w+)"', roles)}
    assert names == set(curve.function_environment_names())
    assert "local.function_curve_env" in str(of_type(tf, "aws_lambda_function")["tensor"]["environment"])
    validations = " ".join(str(v) for v in tf["variable"]["curve_public_keys"]["validation"])
    assert set(re.findall(r'"(\w+)"', validations.split("contains([", 1)[1].split("]", 1)[0])) == set(curve.ROLES)


KEY_POLICY = "kms"
# Actions AWS cannot scope to a resource: the only ones that may have "*" as their resource.
UNSCOPABLE = {"ec2:DescribeNetworkInterfaces", "ec2:DescribeSubnets", "ssmmessages:CreateControlChannel",
              "ssmmessages:CreateDataChannel", "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel"}


def test_iam_has_no_wildcard_actions_and_scoped_resources(tf):
    documents = of_type(tf, "aws_iam_policy_document", "data")
    assert {"function", "server", "flow", "bucket", KEY_POLICY} <= set(documents)
    for name, document in documents.items():
        for statement in statements(document):
            actions, resources = statement.get("actions", []), statement.get("resources", [])
            if name == KEY_POLICY:
                # In a key policy "*" is this key; the admin statement is the account root, never anyone.
                for principal in statement["principals"]:
                    assert "*" not in principal["identifiers"], principal
                continue
            if name == "bucket":
                assert statement["effect"] == "Deny"
                continue
            assert actions and not any("*" in a for a in actions), (name, actions)
            if "*" in resources:
                assert set(actions) <= UNSCOPABLE, (name, actions)
    # No managed policies (AWS's are broader than these) and no IAM users or keys.
    assert not of_type(tf, "aws_iam_role_policy_attachment") and not of_type(tf, "aws_iam_user")
    assert not of_type(tf, "aws_iam_access_key")


def test_servers_read_only_the_store_prefix_and_the_wheel(tf):
    server = {s["sid"]: s for s in statements(of_type(tf, "aws_iam_policy_document", "data")["server"])}
    s3_statements = [s for s in server.values() if any(a.startswith("s3:") for a in s["actions"])]
    assert {a for s in s3_statements for a in s["actions"]} == {"s3:GetObject", "s3:ListBucket"}
    assert server["ReadThePartitionsAndTheWheel"]["resources"] == [
        "${aws_s3_bucket.this.arn}/${var.store_prefix}/*", "${aws_s3_bucket.this.arn}/${local.wheel_key}"]
    listing = server["ListThePartitionPrefix"]
    assert listing["condition"][0]["variable"] == "s3:prefix"
    assert listing["condition"][0]["values"] == ["${var.store_prefix}", "${var.store_prefix}/*"]
    assert server["ThisClustersParameters"]["resources"][1].endswith(":parameter${local.ssm_prefix}/*")
    assert server["InvokeTheFunction"]["resources"][0] == "${aws_lambda_function.tensor.arn}"
    function = {s["sid"]: s for s in statements(of_type(tf, "aws_iam_policy_document", "data")["function"])}
    assert function["OwnLogGroup"]["resources"] == ["${aws_cloudwatch_log_group.function.arn}:*"]
    assert not any(a.startswith(("s3:", "lambda:")) for s in function.values() for a in s["actions"])


def test_secrets_and_instances_are_locked_down(tf):
    for name, parameter in of_type(tf, "aws_ssm_parameter").items():
        assert parameter["type"] == "SecureString" and parameter["key_id"] == "${aws_kms_key.this.arn}", name
    assert tf["variable"]["curve_secret_keys"]["sensitive"] is True
    for name, instance in of_type(tf, "aws_instance").items():
        assert instance["metadata_options"][0]["http_tokens"] == "required", name
        assert instance["associate_public_ip_address"] is False
        assert instance["root_block_device"][0]["encrypted"] is True
        assert instance["subnet_id"] == "${aws_subnet.private.id}"
        assert instance["vpc_security_group_ids"] == ["${aws_security_group.servers.id}"]


def test_the_example_sets_only_what_the_module_takes():
    module_vars = load(MODULE)["variable"]
    example = load(EXAMPLE)
    with open(EXAMPLE / "example.tfvars") as f:
        tfvars = _unquote(hcl2.load(f))
    assert set(tfvars) <= set(example["variable"]), set(tfvars) - set(example["variable"])
    call = example["module"]["dorylus"]
    assert call["source"] == "../"
    passed = {k for k in call if k != "source"}
    assert passed <= set(module_vars) and passed == set(example["variable"]) - {"region"}
    assert all(call[k] == f"${{var.{k}}}" for k in passed)
    required = {name for name, body in module_vars.items() if "default" not in body}
    assert required <= passed and required <= set(tfvars)
    assert re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", tfvars["bucket_name"])
    assert tfvars["ssh_cidr_blocks"] == []
    for name, body in module_vars.items():
        assert body.get("description"), f"variable {name} has no description"


# ----------------------------------------------------------------------------- user data


def render_user_data(tf: dict, role: str, tmp_path: Path, cluster: dict, spot_watch: str = "off") -> str:
    """templatefile() for the servers' user data: every ${name} must be a variable it is given."""
    template = (MODULE / "user_data.sh.tftpl").read_text()
    given = set(tf["locals"]["user_data_common"]) | {"role", "index", "spot_watch"}
    used = set(re.findall(r"(?<!\$)\$\{(\w+)\}", template))
    assert used == given, (used ^ given)
    assert "%{" not in template and not re.search(r"(?<!\$)\$\{(?!\w+\})", template)
    values = {"cluster_json": json.dumps(cluster), "train_json": json.dumps({"model": "gcn"}), "region": "us-east-1",
              "wheel_uri": "s3://b/deploy/dorylus-0.1.0-py3-none-any.whl",
              "wheel_name": "dorylus-0.1.0-py3-none-any.whl", "torch_pip_spec": "torch==2.13.0",
              "torch_index_url": "https://download.pytorch.org/whl/cpu", "role": role, "index": "1",
              "spot_watch": spot_watch}
    rendered = re.sub(r"(?<!\$)\$\{(\w+)\}", lambda m: values[m[1]], template).replace("$${", "${")
    script = tmp_path / f"{role}.sh"
    script.write_text(rendered)
    subprocess.run(["bash", "-n", str(script)], check=True)
    return rendered


def heredoc(text: str, marker: str, after: str) -> str:
    start = text.index(f"{after} <<'{marker}'\n") + len(f"{after} <<'{marker}'\n")
    return text[start:text.index(f"\n{marker}\n", start)]


STUBS = {
    "boto3.py": '''
import json, os
class _Pages:
    def paginate(self, **kw):
        assert kw == {"Path": "/demo/curve/", "Recursive": True, "WithDecryption": True}, kw
        return [{"Parameters": [{"Name": f"/demo/curve/{role}/{kind}", "Value": role[0].upper() + kind[0] * 39}
                                for role in ("coordinator", "graphserver", "paramserver", "function")
                                for kind in ("public", "secret")]}]
class _Client:
    def get_paginator(self, name):
        assert name == "get_parameters_by_path"
        return _Pages()
def client(name):
    assert name == "ssm"
    return _Client()
''',
    "dorylus/__init__.py": "",
    "dorylus/cli.py": "import json\ndef main(argv):\n    print(json.dumps(argv))\n    return 0\n",
    "dorylus/partition/__init__.py": "",
    "dorylus/partition/s3.py": '''
from types import SimpleNamespace
def read_store_meta(url):
    assert url == "s3://b/stores/x", url
    return SimpleNamespace(num_features=1433, num_classes=7)
''',
}


@pytest.mark.parametrize("spot_watch", ["off", "http://169.254.169.254"])
@pytest.mark.parametrize("role", ["graphserver", "paramserver"])
def test_user_data_starts_the_role_with_flags_the_cli_accepts(tf, tmp_path, role, spot_watch):
    cluster = {"format": "dorylus-cluster/1", "region": "us-east-1", "store": "s3://b/stores/x", "ssm_prefix": "/demo",
               "function": {"name": "demo-tensor"},
               "param_servers": [{"index": 0, "host": "10.42.1.8", "port": 5600},
                                 {"index": 1, "host": "10.42.1.9", "port": 5600}],
               "graph_servers": [{"part": 0, "host": "10.42.1.64", "port": 5500},
                                 {"part": 1, "host": "10.42.1.65", "port": 5500}]}
    rendered = render_user_data(tf, role, tmp_path, cluster, spot_watch)
    role_env = heredoc(rendered, "DORYLUS_ENV", "cat >/etc/dorylus/role.env")
    assert f"DORYLUS_SPOT_WATCH={spot_watch}" in role_env.splitlines()
    assert json.loads(heredoc(rendered, "DORYLUS_JSON", "cat >/etc/dorylus/cluster.json")) == cluster
    assert f"systemctl enable --now dorylus-{role}.service" in rendered
    unit = heredoc(rendered, "DORYLUS_UNIT", f"cat >/etc/systemd/system/dorylus-{role}.service")
    assert "User=dorylus" in unit and "NoNewPrivileges=true" in unit and "ProtectSystem=strict" in unit

    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "cluster.json").write_text(json.dumps(cluster))
    launcher = heredoc(rendered, "DORYLUS_PY", "cat >/usr/local/bin/dorylus-role").replace("/etc/dorylus", str(etc))
    stubs = tmp_path / "stubs"
    for rel, text in STUBS.items():
        (stubs / rel).parent.mkdir(parents=True, exist_ok=True)
        (stubs / rel).write_text(text)
    runtime = tmp_path / "run"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(stubs), "DORYLUS_ROLE": role, "DORYLUS_INDEX": "1",
           "RUNTIME_DIRECTORY": str(runtime), "DORYLUS_SPOT_WATCH": spot_watch}
    result = subprocess.run([sys.executable, "-S", "-c", launcher], env=env, capture_output=True, text=True, timeout=30,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    argv = json.loads(result.stdout)

    # every public key, and the secret of this role only (the layout `--keys` reads), all 0600
    keys = runtime / "curve"
    written = sorted(p.name for p in keys.iterdir())
    assert written == sorted([f"{r}.public" for r in ("coordinator", "graphserver", "paramserver", "function")]
                             + [f"{role}.secret"])
    secret = keys / f"{role}.secret"
    assert secret.read_text() == role[0].upper() + "s" * 39 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700

    from dorylus.cli import build_parser

    args = build_parser().parse_args(argv)  # today's flags of `dorylus graphserver` / `paramserver`
    assert args.command == role
    if role == "graphserver":
        assert (args.store, args.part, args.param_server, args.bind, args.function_name, args.region) == (
            "s3://b/stores/x", 1, "tcp://10.42.1.8:5600", "tcp://10.42.1.65:5500", "demo-tensor", "us-east-1")
        assert args.advertise == "10.42.1.65:5500"
    else:
        assert (args.num_features, args.num_classes, args.bind) == (1433, 7, "tcp://10.42.1.9:5600")
        assert args.advertise == "10.42.1.9:5600"
    assert args.config == str(etc / "train.json")
    assert args.keys == str(keys) and not args.exit_with_parent  # CURVE on; waits for coordinators
    # The watcher polls the instance metadata on spot instances only.
    assert args.spot_watch == (None if spot_watch == "off" else spot_watch)


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform is not on PATH")
def test_terraform_fmt():
    result = subprocess.run(["terraform", "fmt", "-check", "-recursive", "-diff", str(MODULE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- spot graph servers


def _terraform(directory: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """terraform in a scratch directory with no providers: nothing to download, so it runs here."""
    return subprocess.run(["terraform", *args], cwd=directory, input=stdin, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "TF_IN_AUTOMATION": "1", "NO_COLOR": "1"})


def _block(text: str, kind: str, name: str) -> str:
    """The HCL text of one top-level block (variable "name" { ... }), as written."""
    match = re.search(rf'^{kind} "{name}" {{\n.*?^}}\n', text, re.S | re.M)
    assert match, (kind, name)
    return match.group(0)


def test_on_demand_and_spot_are_exclusive_and_on_demand_is_the_default(tf):
    market = tf["variable"]["graph_server_market"]
    assert market["default"] == "on-demand" and market["type"] == "string"
    assert tf["locals"]["graph_spot"] == '${var.graph_server_market == "spot"}'
    spot_only = "${local.graph_spot ? var.graph_server_count : 0}"
    assert of_type(tf, "aws_instance")["graph_server"]["count"] == "${local.graph_spot ? 0 : var.graph_server_count}"
    assert of_type(tf, "aws_instance")["param_server"]["count"] == "${var.param_server_count}"  # always on-demand
    assert of_type(tf, "aws_launch_template")["graph_server"]["count"] == spot_only
    assert of_type(tf, "aws_autoscaling_group")["graph_server"]["count"] == spot_only
    for rtype in ("aws_cloudwatch_log_group", "aws_cloudwatch_event_rule", "aws_cloudwatch_event_target",
                  "aws_cloudwatch_log_resource_policy"):
        for name, body in of_type(tf, rtype).items():
            if name not in ("function", "flow"):
                assert body["count"] == "${local.graph_spot ? 1 : 0}", (rtype, name)
    assert "instance_market_options" not in str(of_type(tf, "aws_instance"))  # spot lives in the groups only


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform is not on PATH")
@pytest.mark.parametrize("name, value, ok", [
    ("graph_server_market", "on-demand", True), ("graph_server_market", "spot", True),
    ("graph_server_market", "Spot", False), ("graph_server_market", "", False),
    ("graph_server_spot_types", '["c5n.2xlarge", "m5.2xlarge"]', True), ("graph_server_spot_types", '["c5n"]', False),
    ("graph_server_spot_types", "[" + ", ".join(['"c5.large"'] * 20) + "]", False),
    ("graph_server_termination_grace_s", "30", True), ("graph_server_termination_grace_s", "7200", True),
    ("graph_server_termination_grace_s", "29", False), ("graph_server_termination_grace_s", "90.5", False),
])
def test_the_spot_variables_validation(tmp_path, name, value, ok):
    """The module's own variable blocks, evaluated by terraform (no provider needed for them)."""
    (tmp_path / "variables.tf").write_text(_block((MODULE / "variables.tf").read_text(), "variable", name))
    result = _terraform(tmp_path, "console", "-var", f"{name}={value}", stdin=f"var.{name}\n")
    assert ("Invalid value for variable" not in result.stderr) == ok, result.stderr


def test_spot_groups_are_one_spot_instance_each_at_the_parts_address(tf):
    group = of_type(tf, "aws_autoscaling_group")["graph_server"]
    assert (group["min_size"], group["max_size"], group["desired_capacity"]) == (1, 1, 1)
    assert group["vpc_zone_identifier"] == ["${aws_subnet.private.id}"]
    assert group["capacity_rebalance"] is False  # a pinned address: a replacement cannot start early (servers.tf)
    policy = group["mixed_instances_policy"][0]
    distribution = policy["instances_distribution"][0]
    assert distribution == {"on_demand_base_capacity": 0, "on_demand_percentage_above_base_capacity": 0,
                            "spot_allocation_strategy": "capacity-optimized"}
    spec = policy["launch_template"][0]["launch_template_specification"][0]
    assert spec["launch_template_id"] == "${aws_launch_template.graph_server[count.index].id}"
    override = policy["launch_template"][0]["dynamic"][0]["override"]
    assert override["for_each"] == "${local.graph_spot_types}"
    assert override["content"][0]["instance_type"] == "${override.value}"
    assert "var.graph_server_instance_type" in tf["locals"]["graph_spot_types"]
    tags = group["dynamic"][0]["tag"]
    assert "dorylus:role" in tags["for_each"] and tags["content"][0]["propagate_at_launch"] is True

    template = of_type(tf, "aws_launch_template")["graph_server"]
    (nic,) = template["network_interfaces"]
    assert nic["private_ip_address"] == "${local.graph_server_ips[count.index]}"  # the cluster file's host
    assert nic["associate_public_ip_address"] is False and nic["device_index"] == 0
    assert nic["security_groups"] == ["${aws_security_group.servers.id}"]
    assert "vpc_security_group_ids" not in template  # with an interface named, groups belong on it
    metadata = template["metadata_options"][0]
    assert metadata["http_tokens"] == "required" and metadata["http_put_response_hop_limit"] == 1
    ebs = template["block_device_mappings"][0]["ebs"][0]
    assert ebs["encrypted"] is True and ebs["volume_size"] == "${var.root_volume_gb}"
    assert template["iam_instance_profile"][0]["name"] == "${aws_iam_instance_profile.server.name}"
    assert template["image_id"] == "${local.ami.graph}"
    assert "spot_watch = local.spot_watch.graph" in template["user_data"] and "base64encode" in template["user_data"]
    assert tf["locals"]["spot_watch"] == {"graph": '${local.graph_spot ? "http://169.254.169.254" : "off"}',
                                          "param": "off"}


def test_a_terminating_graph_server_gets_time_to_checkpoint(tf):
    (hook,) = of_type(tf, "aws_autoscaling_group")["graph_server"]["initial_lifecycle_hook"]
    assert hook["lifecycle_transition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert hook["heartbeat_timeout"] == "${var.graph_server_termination_grace_s}"
    assert hook["default_result"] == "CONTINUE"  # the termination goes ahead when the time is up
    assert "notification_target_arn" not in hook and "role_arn" not in hook  # the instance learns it from IMDS
    from dorylus import spot

    assert spot.PATHS["autoscaling"].endswith("/autoscaling/target-lifecycle-state")


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform is not on PATH")
def test_event_rules_match_the_interruption_events(tf, tmp_path):
    rules = of_type(tf, "aws_cloudwatch_event_rule")
    assert set(rules) == {"spot_interruption", "graph_server_terminating"}

    def pattern(name: str) -> dict:
        expression = rules[name]["event_pattern"][2:-1].replace(
            "aws_autoscaling_group.graph_server[*].name", '["demo-graphserver-0", "demo-graphserver-1"]')
        result = _terraform(tmp_path, "console", stdin=expression + "\n")
        assert result.returncode == 0, result.stderr
        return json.loads(json.loads(result.stdout.strip().splitlines()[-1]))

    assert pattern("spot_interruption") == {
        "source": ["aws.ec2"],
        "detail-type": ["EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation"]}
    assert pattern("graph_server_terminating") == {
        "source": ["aws.autoscaling"], "detail-type": ["EC2 Instance-terminate Lifecycle Action"],
        "detail": {"AutoScalingGroupName": ["demo-graphserver-0", "demo-graphserver-1"]}}
    targets = of_type(tf, "aws_cloudwatch_event_target")
    for name in rules:
        assert targets[name]["rule"] == f"${{aws_cloudwatch_event_rule.{name}[0].name}}"
        assert targets[name]["arn"] == "${aws_cloudwatch_log_group.spot_events[0].arn}"
    log = of_type(tf, "aws_cloudwatch_log_group")["spot_events"]
    assert log["kms_key_id"] == "${aws_kms_key.this.arn}"
    # The key policy already lets CloudWatch Logs use the key for /dorylus/<name>/* groups.
    assert log["name"].startswith("/dorylus/${var.name}/")
    kms_logs = statements(of_type(tf, "aws_iam_policy_document", "data")["kms"])[1]
    assert any(v.endswith(":log-group:/dorylus/${var.name}/*") for v in kms_logs["condition"][0]["values"])


def test_eventbridge_may_write_only_this_log_group_and_only_the_two_rules(tf):
    documents = of_type(tf, "aws_iam_policy_document", "data")
    policy = of_type(tf, "aws_cloudwatch_log_resource_policy")["spot_events"]
    assert policy["policy_document"] == "${data.aws_iam_policy_document.spot_events[0].json}"
    found = {s["sid"]: s for s in statements(documents["spot_events"])}
    assert set(found) == {"EventBridgeCreatesStreamsInThisGroup", "EventBridgeWritesTheTwoRulesEvents"}
    group = "${aws_cloudwatch_log_group.spot_events[0].arn}"
    create, put = found["EventBridgeCreatesStreamsInThisGroup"], found["EventBridgeWritesTheTwoRulesEvents"]
    assert create["actions"] == ["logs:CreateLogStream"] and create["resources"] == [f"{group}:*"]
    assert put["actions"] == ["logs:PutLogEvents"] and put["resources"] == [f"{group}:*:*"]
    for statement in (create, put):
        (principal,) = statement["principals"]
        assert principal["type"] == "Service"
        assert set(principal["identifiers"]) == {"events.amazonaws.com", "delivery.logs.amazonaws.com"}
    (condition,) = put["condition"]
    assert condition["test"] == "ArnEquals" and condition["variable"] == "aws:SourceArn"
    assert condition["values"] == ["${aws_cloudwatch_event_rule.spot_interruption[0].arn}",
                                   "${aws_cloudwatch_event_rule.graph_server_terminating[0].arn}"]
    # The servers' role gains nothing for spot: notices come from IMDS, the hook ends by timing out.
    server_actions = {a for s in statements(documents["server"]) for a in s["actions"]}
    assert not any(a.startswith(("autoscaling:", "events:", "ec2:")) for a in server_actions)


def test_the_spot_example_sets_only_the_examples_variables():
    example = load(EXAMPLE)
    with open(EXAMPLE / "spot.tfvars") as f:
        tfvars = _unquote(hcl2.load(f))
    assert tfvars["graph_server_market"] == "spot"
    assert set(tfvars) <= set(example["variable"])
    assert all(re.fullmatch(r"[a-z][a-z0-9-]*\.[a-z0-9]+", t) for t in tfvars["graph_server_spot_types"])
    assert load(MODULE)["output"]["graph_server_groups"]["value"] == "${aws_autoscaling_group.graph_server[*].name}"
