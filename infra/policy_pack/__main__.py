"""rayfleet's security rules as a CrossGuard policy pack, mandatory by default:

    pulumi preview --policy-pack infra/policy_pack
    pulumi up --policy-pack infra/policy_pack

Every rule is explained in docs/security.md; pack.py builds one policy per rule.
"""

import sys
from pathlib import Path

# The engine runs this file with only infra/policy_pack/ on sys.path; the checks and the rule
# registry are the repository's (rayfleet/ and infra/), as for the Pulumi program itself.
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))

from pulumi_policy import EnforcementLevel, PolicyPack  # noqa: E402

from infra.policy_pack.pack import PACK_NAME, policies  # noqa: E402

PolicyPack(
    name=PACK_NAME,
    enforcement_level=EnforcementLevel.MANDATORY,
    description="rayfleet security rules (docs/security.md)",
    policies=policies(),
)
