package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// The fake clientset stands in for the API server's answers only: what
// is tested is the order and shape of the two calls the bench's baseline
// makes, which must be the direct pair's.
func TestTheIssuerMakesThePairsCallsAndAnswersTheToken(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset(&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: "runner"}})
	client.PrependReactor("create", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		s := a.(k8stesting.CreateAction).GetObject().(*corev1.Secret).DeepCopy()
		s.Name, s.UID = s.GenerateName+"x1", types.UID("uid-1")
		return true, s, nil
	})
	var bound *authnv1.BoundObjectReference
	var seconds int64
	expires := metav1.NewTime(time.Date(2026, 11, 29, 21, 0, 0, 0, time.UTC))
	client.PrependReactor("create", "serviceaccounts", func(a k8stesting.Action) (bool, runtime.Object, error) {
		require.Equal(t, "token", a.GetSubresource())
		tr := a.(k8stesting.CreateAction).GetObject().(*authnv1.TokenRequest)
		bound, seconds = tr.Spec.BoundObjectRef, *tr.Spec.ExpirationSeconds
		out := tr.DeepCopy()
		out.Status = authnv1.TokenRequestStatus{Token: "the-token", ExpirationTimestamp: expires}
		return true, out, nil
	})
	h := &issuer{client: client}

	body, _ := json.Marshal(apiv1.KubeconfigRequest{Namespace: "bench", ServiceAccount: "runner", TTL: "15m"})
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/kubeconfigs", bytes.NewReader(body)))
	require.Equal(t, http.StatusCreated, rec.Code, rec.Body.String())
	var resp apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &resp))
	require.Equal(t, "the-token", resp.Token)
	require.True(t, expires.Time.Equal(resp.ExpiresAt))
	require.Equal(t, &authnv1.BoundObjectReference{Kind: "Secret", APIVersion: "v1", Name: "bare-x1", UID: "uid-1"}, bound)
	require.Equal(t, int64(900), seconds)
	var verbs []string
	for _, a := range client.Actions() {
		verbs = append(verbs, a.GetVerb()+" "+a.GetResource().Resource)
	}
	require.Equal(t, []string{"create secrets", "create serviceaccounts"}, verbs)
}

func TestTheIssuerRefusesARequestItCannotServe(t *testing.T) {
	t.Parallel()
	for name, body := range map[string]string{
		"not JSON":              "{",
		"no namespace":          `{"serviceAccount":"runner"}`,
		"no ServiceAccount":     `{"namespace":"bench"}`,
		"a TTL under 10m":       `{"namespace":"bench","serviceAccount":"runner","ttl":"1m"}`,
		"a TTL that is no time": `{"namespace":"bench","serviceAccount":"runner","ttl":"soon"}`,
	} {
		t.Run(name, func(t *testing.T) {
			client := fake.NewClientset()
			rec := httptest.NewRecorder()
			(&issuer{client: client}).ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/kubeconfigs", bytes.NewReader([]byte(body))))
			require.Equal(t, http.StatusBadRequest, rec.Code)
			require.Empty(t, client.Actions(), "nothing is made for a refused request")
		})
	}
}
