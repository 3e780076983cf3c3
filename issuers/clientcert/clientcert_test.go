package clientcert

import (
	"context"
	"crypto"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	certv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/tokenbroker/tokenbroker/issuers"
	"github.com/tokenbroker/tokenbroker/pki"
)

const self = "system:serviceaccount:tokenbroker:tokenbroker"

// fakeCluster answers SelfSubjectReview with self and records the CSR
// creator the API server would: creator.
func fakeCluster(creator string) *fake.Clientset {
	c := fake.NewClientset()
	c.PrependReactor("create", "selfsubjectreviews", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, &authnv1.SelfSubjectReview{Status: authnv1.SelfSubjectReviewStatus{UserInfo: authnv1.UserInfo{Username: self}}}, nil
	})
	c.PrependReactor("create", "certificatesigningrequests", func(a k8stesting.Action) (bool, runtime.Object, error) {
		csr := a.(k8stesting.CreateAction).GetObject().(*certv1.CertificateSigningRequest).DeepCopy()
		csr.Spec.Username = creator
		return true, csr, c.Tracker().Add(csr)
	})
	return c
}

func request(t *testing.T) issuers.Request {
	t.Helper()
	csrPEM, _, user, err := pki.NewUserCSR(func(crypto.PublicKey) (string, error) {
		return "tokenbroker:west:00112233445566778899aabbccddeeff", nil
	}, nil)
	require.NoError(t, err)
	csr, _, err := pki.ParseUserCSRPEM(csrPEM)
	require.NoError(t, err)
	return issuers.Request{
		Namespace: "argo", TTL: time.Hour, CSR: csr, User: user,
		Role:  issuers.RoleRef{Kind: "ClusterRole", Name: "view"},
		Lease: issuers.ObjectRef{Kind: "Secret", Name: "tokenbroker-lease-abc", UID: "uid-1"},
	}
}

func approvals(c *fake.Clientset) int {
	n := 0
	for _, a := range c.Actions() {
		if a.GetSubresource() == "approval" {
			n++
		}
	}
	return n
}

// The API server records who created a CSR; the issuer approves only what
// it recorded as this broker's, and cleans up everything else it made.
func TestACSRTheAPIServerSaysSomeoneElseCreatedIsNeverApproved(t *testing.T) {
	t.Parallel()
	c := fakeCluster("mallory")
	_, err := New(c, time.Second, nil).Issue(context.Background(), request(t))
	require.ErrorContains(t, err, `was created by "mallory", not by this broker`)
	require.Zero(t, approvals(c))
	rbs, err := c.RbacV1().RoleBindings("argo").List(context.Background(), metav1ListAll)
	require.NoError(t, err)
	require.Empty(t, rbs.Items, "the RoleBinding is deleted again")
	csrs, err := c.CertificatesV1().CertificateSigningRequests().List(context.Background(), metav1ListAll)
	require.NoError(t, err)
	require.Empty(t, csrs.Items, "the CSR is deleted again")
}

// A CSR whose subject is not the user asked for never reaches the API
// server.
func TestACSRForAnotherUserIsRefusedBeforeAnythingIsCreated(t *testing.T) {
	t.Parallel()
	c := fakeCluster(self)
	req := request(t)
	req.User = "tokenbroker:west:ffffffffffffffffffffffffffffffff"
	_, err := New(c, time.Second, nil).Issue(context.Background(), req)
	require.ErrorContains(t, err, "the CSR asks for user")
	require.Empty(t, c.Actions())
}

// Without a signer the watch ends at the timeout: ErrNotSigned, and the
// RoleBinding and the CSR are gone.
func TestNoSignerMeansErrNotSignedAndNothingLeft(t *testing.T) {
	t.Parallel()
	c := fakeCluster(self)
	_, err := New(c, 50*time.Millisecond, nil).Issue(context.Background(), request(t))
	require.ErrorIs(t, err, ErrNotSigned)
	require.Equal(t, 1, approvals(c))
	rbs, _ := c.RbacV1().RoleBindings("argo").List(context.Background(), metav1ListAll)
	require.Empty(t, rbs.Items)
	csrs, _ := c.CertificatesV1().CertificateSigningRequests().List(context.Background(), metav1ListAll)
	require.Empty(t, csrs.Items)
}

var metav1ListAll = metav1.ListOptions{}
