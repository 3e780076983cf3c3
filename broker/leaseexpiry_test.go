package broker

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// A client certificate lives the CSR API's minimum of 10m at least; its
// only permission is the lease's RoleBinding, which goes at the lease's
// expiry, before the Secret, as on a revocation.
func TestAnExpiredCertificateLeaseLosesItsRoleBindingAndItsSecretAtItsExpiry(t *testing.T) {
	t.Parallel()
	e, clk := newLimitsEnv(t, testPolicy)
	e.b.cfg.RoleBindings = e.client.RbacV1()
	ctx := context.Background()
	name := objects.LeaseSecretPrefix + "aaaaaaaaaaaaaaaaaaaaaaaaaa"
	s, err := e.client.CoreV1().Secrets("argo").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: name, UID: "u1"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	// The lease owns its binding, as the clientcert issuer makes it.
	owner := metav1.OwnerReference{APIVersion: "v1", Kind: "Secret", Name: name, UID: s.UID}
	_, err = e.client.RbacV1().RoleBindings("argo").Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: name, UID: "rb1",
		OwnerReferences: []metav1.OwnerReference{owner}}}, metav1.CreateOptions{})
	require.NoError(t, err)

	e.b.expireLeaseAt(s, apiv1.CredentialClientCertificate, clk.Now().Add(time.Minute), zap.NewNop())
	bindings := func() int {
		l, err := e.client.RbacV1().RoleBindings("argo").List(ctx, metav1.ListOptions{})
		require.NoError(t, err)
		return len(l.Items)
	}
	require.Eventually(t, clk.HasWaiters, 5*time.Second, time.Millisecond, "the timer is set")
	clk.Step(59 * time.Second)
	require.Never(t, func() bool { return bindings() == 0 }, 100*time.Millisecond, 10*time.Millisecond)
	clk.Step(time.Second)
	require.Eventually(t, func() bool { return bindings() == 0 && e.leaseCount(t) == 0 }, 5*time.Second, 10*time.Millisecond)
}

// A binding of the lease's name that the lease does not own (made by
// someone else after a revocation, say) is left alone at the expiry.
func TestAnExpiredLeaseLeavesARoleBindingItDoesNotOwn(t *testing.T) {
	t.Parallel()
	e, clk := newLimitsEnv(t, testPolicy)
	e.b.cfg.RoleBindings = e.client.RbacV1()
	ctx := context.Background()
	name := objects.LeaseSecretPrefix + "bbbbbbbbbbbbbbbbbbbbbbbbbb"
	s, err := e.client.CoreV1().Secrets("argo").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: name, UID: "u2"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = e.client.RbacV1().RoleBindings("argo").Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: name, UID: "rb2"}}, metav1.CreateOptions{})
	require.NoError(t, err)

	e.b.expireLeaseAt(s, apiv1.CredentialClientCertificate, clk.Now().Add(time.Minute), zap.NewNop())
	require.Eventually(t, clk.HasWaiters, 5*time.Second, time.Millisecond, "the timer is set")
	clk.Step(time.Minute)
	require.Eventually(t, func() bool { return e.leaseCount(t) == 0 }, 5*time.Second, 10*time.Millisecond, "the lease goes")
	_, err = e.client.RbacV1().RoleBindings("argo").Get(ctx, name, metav1.GetOptions{})
	require.NoError(t, err, "the binding it does not own stays")
}
