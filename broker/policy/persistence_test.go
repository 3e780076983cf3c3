package policy

import (
	"testing"

	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
)

func TestRulesThatLetTheHolderOutliveTheLeaseAreFound(t *testing.T) {
	t.Parallel()
	rule := func(verbs, groups, resources []string, names ...string) rbacv1.PolicyRule {
		return rbacv1.PolicyRule{Verbs: verbs, APIGroups: groups, Resources: resources, ResourceNames: names}
	}
	core := []string{""}
	tests := []struct {
		name  string
		rules []rbacv1.PolicyRule
		want  []string
	}{
		{name: "get and list of everything in the namespace but Secrets and exec is no persistence",
			rules: []rbacv1.PolicyRule{rule([]string{"get", "list", "watch"}, []string{"", "apps", "batch"}, []string{"pods", "configmaps", "serviceaccounts", "deployments", "jobs"})}},
		{name: "reading Secrets is persistence (a legacy ServiceAccount token Secret never expires)",
			rules: []rbacv1.PolicyRule{rule([]string{"get", "list", "watch"}, core, []string{"secrets"})}, want: []string{"get secrets", "list secrets"}},
		{name: "exec into a pod, by POST or by WebSocket GET, is persistence",
			rules: []rbacv1.PolicyRule{rule([]string{"create", "get"}, core, []string{"pods/exec"})}, want: []string{"create pods/exec", "get pods/exec"}},
		{name: "changing a running pod or adding an ephemeral container to it is persistence",
			rules: []rbacv1.PolicyRule{rule([]string{"update", "patch"}, core, []string{"pods", "pods/ephemeralcontainers"})},
			want:  []string{"update pods", "patch pods", "update pods/ephemeralcontainers", "patch pods/ephemeralcontainers"}},
		{name: "patching or updating any workload's pod template is persistence",
			rules: []rbacv1.PolicyRule{rule([]string{"patch"}, []string{"apps"}, []string{"deployments", "statefulsets"}),
				rule([]string{"update"}, []string{"", "apps", "batch"}, []string{"daemonsets", "jobs", "cronjobs", "replicasets", "replicationcontrollers"})},
			want: []string{"update replicationcontrollers", "patch deployments.apps", "update replicasets.apps", "update daemonsets.apps",
				"patch statefulsets.apps", "update jobs.batch", "update cronjobs.batch"}},
		{name: "creating ReplicaSets and ReplicationControllers is persistence",
			rules: []rbacv1.PolicyRule{rule([]string{"create"}, []string{"", "apps"}, []string{"replicasets", "replicationcontrollers"})},
			want:  []string{"create replicationcontrollers", "create replicasets.apps"}},
		{name: "CertificateSigningRequests and signers are cluster-scoped and not what a RoleBinding gives",
			rules: []rbacv1.PolicyRule{rule([]string{"create", "approve"}, []string{"certificates.k8s.io"}, []string{"certificatesigningrequests", "signers"})}},
		{name: "creating Secrets is persistence (a ServiceAccount token Secret never expires)",
			rules: []rbacv1.PolicyRule{rule([]string{"create"}, core, []string{"secrets"})}, want: []string{"create secrets"}},
		{name: "creating ServiceAccount tokens is persistence",
			rules: []rbacv1.PolicyRule{rule([]string{"create"}, core, []string{"serviceaccounts/token"})}, want: []string{"create serviceaccounts/token"}},
		{name: "a subresource wildcard covers the token subresource",
			rules: []rbacv1.PolicyRule{rule([]string{"create"}, core, []string{"serviceaccounts/*"})}, want: []string{"create serviceaccounts/token"}},
		{name: "a wildcard verb on pods and deployments is persistence",
			rules: []rbacv1.PolicyRule{rule([]string{"*"}, []string{"", "apps"}, []string{"pods", "deployments"})}, want: []string{"create pods", "update pods", "patch pods", "create deployments.apps", "update deployments.apps", "patch deployments.apps"}},
		{name: "changing an existing Deployment's pod template is persistence",
			rules: []rbacv1.PolicyRule{rule([]string{"get", "update"}, []string{"apps"}, []string{"deployments"})}, want: []string{"update deployments.apps"}},
		{name: "creating a Secret of one name is no create at all",
			rules: []rbacv1.PolicyRule{rule([]string{"create"}, core, []string{"secrets"}, "only-this")}},
		{name: "binding one named role is still binding",
			rules: []rbacv1.PolicyRule{rule([]string{"bind"}, []string{"rbac.authorization.k8s.io"}, []string{"roles"}, "admin")}, want: []string{"bind roles.rbac.authorization.k8s.io"}},
		{name: "cluster-scoped abilities are not what a RoleBinding gives",
			rules: []rbacv1.PolicyRule{rule([]string{"impersonate"}, core, []string{"users", "groups"}), rule([]string{"create"}, []string{"rbac.authorization.k8s.io"}, []string{"clusterrolebindings"})}},
		{name: "impersonating ServiceAccounts is persistence",
			rules: []rbacv1.PolicyRule{rule([]string{"impersonate"}, core, []string{"serviceaccounts"})}, want: []string{"impersonate serviceaccounts"}},
		{name: "cluster-admin's rule has every ability a namespace can give",
			rules: []rbacv1.PolicyRule{rule([]string{"*"}, []string{"*"}, []string{"*"})},
			want: []string{"create secrets", "get secrets", "list secrets", "create serviceaccounts/token", "create rolebindings.rbac.authorization.k8s.io",
				"create pods", "update pods", "patch pods", "create pods/exec", "get pods/exec", "update pods/ephemeralcontainers", "patch pods/ephemeralcontainers",
				"create replicationcontrollers", "update replicationcontrollers", "patch replicationcontrollers",
				"create deployments.apps", "update deployments.apps", "patch deployments.apps",
				"create replicasets.apps", "update replicasets.apps", "patch replicasets.apps",
				"create daemonsets.apps", "update daemonsets.apps", "patch daemonsets.apps",
				"create statefulsets.apps", "update statefulsets.apps", "patch statefulsets.apps",
				"create jobs.batch", "update jobs.batch", "patch jobs.batch",
				"create cronjobs.batch", "update cronjobs.batch", "patch cronjobs.batch",
				"escalate roles.rbac.authorization.k8s.io", "bind roles.rbac.authorization.k8s.io", "impersonate serviceaccounts"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, rulesAllow(tc.rules))
		})
	}
}
