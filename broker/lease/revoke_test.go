package lease

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// A client certificate's lease whose credential annotation someone
// rewrote to "token" still loses its RoleBinding at revocation: the
// certificate's rights go with the lease, not with what it says it is.
func TestARevocationDeletesTheRoleBindingTheLeaseOwnsWhateverItsCredentialAnnotationSays(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := NewSecret(idA, "argo", west, "", apiv1.CredentialClientCertificate, "g", time.Now().Add(time.Hour))
	s.UID = "lease-uid"
	s.Annotations[objects.AnnotationCred] = apiv1.CredentialToken // the tenant's edit
	owned := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: s.Name, UID: "rb-uid",
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Secret", Name: s.Name, UID: s.UID}}}}
	client := fake.NewClientset(s, owned)
	d := &Deleter{Secrets: client.CoreV1(), RoleBindings: client.RbacV1()}

	bindingErr, err := d.Revoke(ctx, s)
	require.NoError(t, err)
	require.NoError(t, bindingErr)
	_, err = client.RbacV1().RoleBindings("argo").Get(ctx, s.Name, metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err), "the certificate's permission is gone: %v", err)
}

// A broker that may not read RoleBindings (it issues no client
// certificates) revokes a token's lease without a binding error; a
// certificate's lease it cannot clean up is reported.
func TestARevocationThatMayNotReadRoleBindingsReportsItOnlyForACertificate(t *testing.T) {
	t.Parallel()
	for cred, wantErr := range map[string]bool{apiv1.CredentialToken: false, apiv1.CredentialClientCertificate: true} {
		s := NewSecret(idA, "argo", west, "", cred, "g", time.Now().Add(time.Hour))
		client := fake.NewClientset(s)
		client.PrependReactor("get", "rolebindings", func(k8stesting.Action) (bool, runtime.Object, error) {
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Group: "rbac.authorization.k8s.io", Resource: "rolebindings"}, s.Name, nil)
		})
		bindingErr, err := (&Deleter{Secrets: client.CoreV1(), RoleBindings: client.RbacV1()}).Revoke(context.Background(), s)
		require.NoError(t, err, cred)
		require.Equal(t, wantErr, bindingErr != nil, "%s: %v", cred, bindingErr)
	}
}
