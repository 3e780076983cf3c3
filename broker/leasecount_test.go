package broker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/tenants"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"
)

// TestWithoutAClusterWideListTheGCRevokesWhatTheCounterSaw: with
// per-namespace RBAC a full GC pass's cluster-wide list is forbidden; the
// leases the counter saw in a namespace that left its grant are revoked
// all the same.
func TestWithoutAClusterWideListTheGCRevokesWhatTheCounterSaw(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset()
	client.PrependReactor("list", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetNamespace() == "" {
			return true, nil, apierrors.NewForbidden(corev1.Resource("secrets"), "", errors.New("no cluster-wide list"))
		}
		return false, nil, nil
	})
	nss := newFakeNamespaces()
	nss.set("oil-dev", nil) // left the grant
	nss.synced = true
	clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	lc := lease.NewCounter(nil, clk, zap.NewNop())
	b, err := New(Config{Secrets: client.CoreV1(), Policy: policy.NewStore(mustPolicy(t, tenantPolicy)), Logger: zap.NewNop(),
		Clock: clk, Namespaces: nss, Leases: lc, Pool: lease.PoolConfig{PerNamespace: -1}})
	require.NoError(t, err)
	t.Cleanup(b.tenants.Queue.ShutDown)
	s := b.leaseSecret("aaaaaaaaaaaaaaaaaaaaaaaaaa", west, policy.Decision{Peer: "west", Credential: apiv1.CredentialToken, Grant: "oil"},
		apiv1.KubeconfigRequest{Namespace: "oil-dev", ServiceAccount: "gitops-reconciler"}, clk.Now().Add(time.Hour))
	s.Annotations[objects.AnnotationRevokeOnUnmatch] = "0s"
	_, err = client.CoreV1().Secrets("oil-dev").Create(context.Background(), s, metav1.CreateOptions{})
	require.NoError(t, err)
	lc.Observe(&metav1.PartialObjectMetadata{ObjectMeta: s.ObjectMeta})

	_, err = b.CollectGarbage(context.Background()) // the first pass is a full one
	require.NoError(t, err)
	clk.Step(tenants.UncoveredRecheck)
	require.Eventually(t, func() bool { return b.tenants.Queue.Len() > 0 }, 5*time.Second, time.Millisecond)
	for b.tenants.Queue.Len() > 0 {
		item, _ := b.tenants.Queue.Get()
		require.NoError(t, b.revoker().Revoke(context.Background(), item))
		b.tenants.Queue.Done(item)
	}
	l, err := client.CoreV1().Secrets("oil-dev").List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	require.Empty(t, l.Items)
}
