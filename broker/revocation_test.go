package broker

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

func TestParseRevocations(t *testing.T) {
	t.Parallel()
	entries, problems := enrollment.ParseRevocations(map[string]string{
		enrollment.RevocationKeyIdentities: "spiffe://oc.example/cluster/west  # 2030-01-01T00:00:00Z leaked\n\n  # a comment line\nspiffe://oc.example/cluster/north\n",
		enrollment.RevocationKeySerials:    "3F:9A:0C\n00ff  # leading zeros\nnot-hex\n0x1b\n",
		"unknown":                          "ignored",
	})
	require.Equal(t, []enrollment.RevocationEntry{
		{Kind: enrollment.RevokeIdentity, Value: "spiffe://oc.example/cluster/west", Comment: "2030-01-01T00:00:00Z leaked"},
		{Kind: enrollment.RevokeIdentity, Value: "spiffe://oc.example/cluster/north"},
		{Kind: enrollment.RevokeSerial, Value: "3f9a0c"},
		{Kind: enrollment.RevokeSerial, Value: "ff", Comment: "leading zeros"},
		{Kind: enrollment.RevokeSerial, Value: "1b"},
	}, entries)
	require.Len(t, problems, 1)
	require.Contains(t, problems[0], "serials line 3")

	d := enrollment.NewDenyList(entries)
	require.True(t, d.Revoked("spiffe://oc.example/cluster/west"))
	require.True(t, d.Revoked("spiffe://oc.example/cluster/south", "1", "ff"))
	require.False(t, d.Revoked("spiffe://oc.example/cluster/south", "1", "fe"))
	require.False(t, (&enrollment.DenyList{}).Revoked("spiffe://oc.example/cluster/west", "ff"))
}

func TestNormalizeSerial(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{"ABCDEF": "abcdef", "00:01:ff": "1ff", " 0x10 ": "10", "0": "0"} {
		got, err := enrollment.NormalizeSerial(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "xyz", "-1", strings.Repeat("f", 65), "1 2"} {
		_, err := enrollment.NormalizeSerial(in)
		require.Error(t, err, in)
	}
}

func TestAddRevocationCreatesThenAppendsAndIsIdempotent(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset()
	cms := client.CoreV1().ConfigMaps(brokerNS)
	ctx := context.Background()
	at := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

	added, err := enrollment.AddRevocation(ctx, cms, enrollment.RevokeIdentity, westID, "key\nleaked", at)
	require.NoError(t, err)
	require.True(t, added)
	added, err = enrollment.AddRevocation(ctx, cms, enrollment.RevokeSerial, "AB:CD", "", at)
	require.NoError(t, err)
	require.True(t, added)
	added, err = enrollment.AddRevocation(ctx, cms, enrollment.RevokeIdentity, westID, "again", at)
	require.NoError(t, err)
	require.False(t, added, "an entry already listed is not added twice")

	cm, err := cms.Get(ctx, enrollment.RevocationConfigMap, metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, objects.ManagedByValue, cm.Labels[objects.LabelManagedBy])
	require.Equal(t, westID+"  # 2030-01-02T03:04:05Z key leaked\n", cm.Data[enrollment.RevocationKeyIdentities])
	require.Equal(t, "abcd  # 2030-01-02T03:04:05Z\n", cm.Data[enrollment.RevocationKeySerials])

	entries, problems, err := enrollment.ReadRevocations(ctx, cms)
	require.NoError(t, err)
	require.Empty(t, problems)
	require.Len(t, entries, 2)

	_, err = enrollment.AddRevocation(ctx, cms, enrollment.RevokeIdentity, "https://not-spiffe", "", at)
	require.Error(t, err)
	_, err = enrollment.AddRevocation(ctx, cms, enrollment.RevokeSerial, "zz", "", at)
	require.Error(t, err)
	_, err = enrollment.AddRevocation(ctx, cms, "fingerprint", "x", "", at)
	require.Error(t, err)
}

func TestAddRevocationRetriesWhenAnotherWriterGotThereFirst(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset()
	var creates, updates atomic.Int32
	client.PrependReactor("create", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		if creates.Add(1) == 1 {
			// Another writer created it between our get and our create.
			err := client.Tracker().Add(&corev1.ConfigMap{
				ObjectMeta: metav1.ObjectMeta{Name: enrollment.RevocationConfigMap, Namespace: brokerNS},
				Data:       map[string]string{enrollment.RevocationKeySerials: "ff\n"},
			})
			if err != nil {
				return true, nil, err
			}
			return true, nil, apierrors.NewAlreadyExists(schema.GroupResource{Resource: "configmaps"}, enrollment.RevocationConfigMap)
		}
		return false, nil, nil
	})
	client.PrependReactor("update", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		if updates.Add(1) == 1 {
			return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "configmaps"}, enrollment.RevocationConfigMap, nil)
		}
		return false, nil, nil
	})
	cms := client.CoreV1().ConfigMaps(brokerNS)
	added, err := enrollment.AddRevocation(context.Background(), cms, enrollment.RevokeIdentity, westID, "", time.Now())
	require.NoError(t, err)
	require.True(t, added)
	require.EqualValues(t, 2, updates.Load(), "a conflict is retried")
	entries, _, err := enrollment.ReadRevocations(context.Background(), cms)
	require.NoError(t, err)
	require.Len(t, entries, 2, "the other writer's entry is kept")
}

func TestTheRevocationListFollowsTheConfigMap(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset()
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	l := enrollment.NewRevocationList(client.CoreV1(), brokerNS, zap.NewNop(), m)

	require.False(t, l.Synced())
	require.True(t, l.Revoked(westID), "nothing is let in before the list is read")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go l.Run(ctx)
	require.NoError(t, l.WaitForSync(ctx))
	require.False(t, l.Revoked(westID), "no ConfigMap means nothing is revoked")

	cms := client.CoreV1().ConfigMaps(brokerNS)
	_, err = enrollment.AddRevocation(ctx, cms, enrollment.RevokeIdentity, westID, "", time.Now())
	require.NoError(t, err)
	require.Eventually(t, func() bool { return l.Revoked(westID) }, 5*time.Second, 10*time.Millisecond)
	_, err = enrollment.AddRevocation(ctx, cms, enrollment.RevokeSerial, "1f", "", time.Now())
	require.NoError(t, err)
	require.Eventually(t, func() bool { return l.Revoked(northID, "1f") }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_revocations", "kind", "serial"))

	// A ConfigMap of the same name elsewhere is not the deny list.
	_, err = enrollment.AddRevocation(ctx, client.CoreV1().ConfigMaps("other"), enrollment.RevokeIdentity, "spiffe://oc.example/cluster/south", "", time.Now())
	require.NoError(t, err)
	require.Never(t, func() bool { return l.Revoked("spiffe://oc.example/cluster/south") }, 200*time.Millisecond, 20*time.Millisecond)

	require.NoError(t, cms.Delete(ctx, enrollment.RevocationConfigMap, metav1.DeleteOptions{}))
	require.Eventually(t, func() bool { return !l.Revoked(westID) }, 5*time.Second, 10*time.Millisecond)
}

func TestAnUnsyncedRevocationListMakesTheBrokerUnready(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset()
	l := enrollment.NewRevocationList(client.CoreV1(), brokerNS, zap.NewNop(), nil)
	b, err := New(Config{Secrets: client.CoreV1(), Policy: policy.NewStore(mustPolicy(t, testPolicy)), Logger: zap.NewNop(), Enrollment: enrollment.Config{Revocations: l}})
	require.NoError(t, err)
	require.ErrorContains(t, b.Ready(context.Background()), "revocation")
	require.True(t, b.Revoked(westID))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go l.Run(ctx)
	require.NoError(t, l.WaitForSync(ctx))
	require.NoError(t, b.Ready(ctx))
	require.False(t, b.Revoked(westID))
}

func FuzzParseRevocations(f *testing.F) {
	f.Add("spiffe://oc.example/cluster/west  # leaked\n", "3F:9A\n00ff # x\nnot-hex\n")
	f.Add("", "")
	f.Add("#\n\n#", "0x\n::\n")
	f.Fuzz(func(t *testing.T, identities, serials string) {
		entries, _ := enrollment.ParseRevocations(map[string]string{enrollment.RevocationKeyIdentities: identities, enrollment.RevocationKeySerials: serials})
		d := enrollment.NewDenyList(entries)
		for _, e := range entries {
			require.NotEmpty(t, e.Value)
			require.NotContains(t, e.Value, "#")
			if e.Kind == enrollment.RevokeSerial {
				n, err := enrollment.NormalizeSerial(e.Value)
				require.NoError(t, err)
				require.Equal(t, e.Value, n, "a normalised serial stays the same")
				require.True(t, d.Revoked("", e.Value))
			} else {
				require.True(t, d.Revoked(e.Value))
			}
		}
	})
}
