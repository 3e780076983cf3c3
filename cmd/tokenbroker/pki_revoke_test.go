package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/broker/enrollment"
)

func TestPKIRevokeWritesAndListsTheDenyList(t *testing.T) {
	t.Parallel()
	cms := fake.NewClientset().CoreV1().ConfigMaps("tokenbroker")
	ctx := context.Background()
	now := func() time.Time { return time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC) }
	run := func(o revokeOptions) string {
		t.Helper()
		require.NoError(t, o.validate())
		var out bytes.Buffer
		require.NoError(t, runPKIRevoke(ctx, cms, o, &out, now))
		return out.String()
	}

	require.Contains(t, run(revokeOptions{Identity: "spiffe://oc.example/cluster/west", Reason: "key leaked"}), "revoked identity spiffe://oc.example/cluster/west")
	require.Contains(t, run(revokeOptions{Serial: "3F:9A"}), "revoked serial 3F:9A")
	require.Contains(t, run(revokeOptions{Identity: "spiffe://oc.example/cluster/west"}), "already revoked")

	cm, err := cms.Get(ctx, enrollment.RevocationConfigMap, metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, "spiffe://oc.example/cluster/west  # 2030-01-02T03:04:05Z key leaked\n", cm.Data[enrollment.RevocationKeyIdentities])
	require.Equal(t, "3f9a  # 2030-01-02T03:04:05Z\n", cm.Data[enrollment.RevocationKeySerials])

	list := run(revokeOptions{List: true})
	lines := strings.Split(strings.TrimSpace(list), "\n")
	require.Len(t, lines, 3)
	require.Contains(t, lines[0], "KIND")
	require.Contains(t, lines[1], "identity")
	require.Contains(t, lines[1], "key leaked")
	require.Contains(t, lines[2], "3f9a")
}

func TestPKIRevokeNeedsExactlyOneAction(t *testing.T) {
	t.Parallel()
	for _, o := range []revokeOptions{
		{},
		{Identity: "spiffe://a/cluster/b", Serial: "ff"},
		{Identity: "spiffe://a/cluster/b", List: true},
		{List: true, Reason: "why"},
	} {
		require.Error(t, o.validate(), "%+v", o)
	}
	var out bytes.Buffer
	err := runPKIRevoke(context.Background(), fake.NewClientset().CoreV1().ConfigMaps("x"), revokeOptions{Serial: "not hex"}, &out, time.Now)
	require.Error(t, err)
}

func TestPKIRevokeIsWiredIntoThePKICommand(t *testing.T) {
	t.Parallel()
	cmd, _, err := newRootCommand().Find([]string{"pki", "revoke"})
	require.NoError(t, err)
	require.Equal(t, "revoke", cmd.Name())
	for _, f := range []string{"identity", "serial", "list", "reason", "kubeconfig", "namespace"} {
		require.NotNil(t, cmd.Flags().Lookup(f), f)
	}
}

func TestPKIRevokeRevokesAWorkloadAndAPod(t *testing.T) {
	t.Parallel()
	cms := fake.NewClientset().CoreV1().ConfigMaps("tokenbroker")
	ctx := context.Background()
	now := func() time.Time { return time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC) }
	const uid = "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54"
	const wl = "spiffe://oc.example/cluster/west/ns/argo/sa/runner"
	for _, o := range []revokeOptions{{PodUID: uid, Reason: "compromised"}, {Identity: wl}} {
		require.NoError(t, o.validate())
		var out bytes.Buffer
		require.NoError(t, runPKIRevoke(ctx, cms, o, &out, now))
		require.Contains(t, out.String(), "revoked ")
	}
	cm, err := cms.Get(ctx, enrollment.RevocationConfigMap, metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, uid+"  # 2030-01-02T03:04:05Z compromised\n", cm.Data[enrollment.RevocationKeyPods])
	entries, problems := enrollment.ParseRevocations(cm.Data)
	require.Empty(t, problems)
	d := enrollment.NewDenyList(entries)
	require.True(t, d.RevokedPod(uid))
	require.False(t, d.RevokedPod("7a1e2f3c-0000-4000-8000-000000000002"))
	require.False(t, d.RevokedPod(""))
	require.True(t, d.Revoked(wl))
	require.False(t, d.Revoked("spiffe://oc.example/cluster/west"), "the workload, not its cluster")

	var out bytes.Buffer
	err = runPKIRevoke(ctx, cms, revokeOptions{PodUID: "runner-0"}, &out, now)
	require.ErrorContains(t, err, "not a Pod uid")
	require.Error(t, revokeOptions{PodUID: uid, Serial: "ff"}.validate())

	// A line of the ConfigMap that is no uid is skipped, and said.
	_, problems = enrollment.ParseRevocations(map[string]string{enrollment.RevocationKeyPods: "runner-0\n" + uid})
	require.Len(t, problems, 1)
}
