package broker

import (
	"context"
	"encoding/base64"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// allLeases walks every page of the caller's leases.
func allLeases(ctx context.Context, b *Broker, c Caller) ([]apiv1.Lease, error) {
	var out []apiv1.Lease
	req := lease.PageRequest{}
	for {
		page, err := b.ListLeases(ctx, c, req)
		if err != nil {
			return nil, err
		}
		out = append(out, page.Items...)
		if page.Continue == "" {
			return out, nil
		}
		req.Continue = page.Continue
	}
}

func TestListLeasesRefusesABadPageRequestWithoutAskingTheAPIServer(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		req   lease.PageRequest
		field string
	}{
		{"A negative limit (what the server passes for an unparsable one) is refused.", lease.PageRequest{Limit: -1}, "limit"},
		{"A limit over the maximum is refused.", lease.PageRequest{Limit: lease.MaxLeasePageSize + 1}, "limit"},
		{"A continue token that is not ours is refused.", lease.PageRequest{Continue: "bm9wZQ"}, "continue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			_, err := e.b.ListLeases(context.Background(), west, tc.req)
			require.Equal(t, problem.KindInvalid, problem.KindOf(err))
			var be *problem.Error
			require.ErrorAs(t, err, &be)
			require.Len(t, be.Fields, 1)
			require.Equal(t, tc.field, be.Fields[0].Field)
			require.Empty(t, e.client.Actions())
		})
	}
}

func TestListLeasesWalksThePeersNamespacesOnePageAtATime(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	inArgo, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "reader"})
	require.NoError(t, err)
	inFlux, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "flux", ServiceAccount: "reader"})
	require.NoError(t, err)
	e.client.ClearActions()

	first, err := e.b.ListLeases(ctx, west, lease.PageRequest{Limit: 1})
	require.NoError(t, err)
	require.Len(t, first.Items, 1)
	require.Equal(t, inArgo.LeaseID, first.Items[0].ID)
	require.NotEmpty(t, first.Continue, "flux is still to come")
	require.Len(t, e.client.Actions(), 1, "one namespace listed for a full page")

	second, err := e.b.ListLeases(ctx, west, lease.PageRequest{Limit: 1, Continue: first.Continue})
	require.NoError(t, err)
	require.Len(t, second.Items, 1)
	require.Equal(t, inFlux.LeaseID, second.Items[0].ID)
	require.Empty(t, second.Continue, "the last page")
	require.Equal(t, "flux", e.client.Actions()[1].GetNamespace())

	t.Run("A token whose namespace left the peer's grants resumes at the next namespace.", func(t *testing.T) {
		page, err := e.b.ListLeases(ctx, west, lease.PageRequest{Continue: lease.EncodeContinue(lease.Cursor{Namespace: "b-gone", APIContinue: "abc"})})
		require.NoError(t, err)
		require.Len(t, page.Items, 1)
		require.Equal(t, inFlux.LeaseID, page.Items[0].ID)
		require.Empty(t, page.Continue)
	})

	t.Run("A token past the peer's last namespace gives an empty last page.", func(t *testing.T) {
		page, err := e.b.ListLeases(ctx, west, lease.PageRequest{Continue: lease.EncodeContinue(lease.Cursor{Namespace: "zzz"})})
		require.NoError(t, err)
		require.Empty(t, page.Items)
		require.NotNil(t, page.Items, "items is [] on the wire, never null")
		require.Empty(t, page.Continue)
	})
}

// apiServerPaging makes the clientset's Secret lists page as the API
// server pages them: selected by label, in name order, at most Limit
// items from the continue offset, and, as the API server may, fewer than
// asked (maxAnswer) with a continue token still. fetched counts the
// Secrets handed out and asked the Limits asked for.
func apiServerPaging(t *testing.T, client *fake.Clientset, maxAnswer int) (fetched *int, asked *[]int64) {
	t.Helper()
	fetched, asked = new(int), new([]int64)
	gvr, gvk := corev1.SchemeGroupVersion.WithResource("secrets"), corev1.SchemeGroupVersion.WithKind("Secret")
	client.PrependReactor("list", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		opts := a.(k8stesting.ListActionImpl).ListOptions
		*asked = append(*asked, opts.Limit)
		obj, err := client.Tracker().List(gvr, gvk, a.GetNamespace())
		require.NoError(t, err)
		sel, err := labels.Parse(opts.LabelSelector)
		require.NoError(t, err)
		var all []corev1.Secret
		for _, s := range obj.(*corev1.SecretList).Items {
			if sel.Matches(labels.Set(s.Labels)) {
				all = append(all, s)
			}
		}
		slices.SortFunc(all, func(a, b corev1.Secret) int { return strings.Compare(a.Name, b.Name) })
		from := 0
		if opts.Continue != "" {
			raw, err := base64.StdEncoding.DecodeString(opts.Continue)
			require.NoError(t, err)
			from, err = strconv.Atoi(string(raw))
			require.NoError(t, err)
		}
		n := min(len(all)-from, maxAnswer)
		if opts.Limit > 0 {
			n = min(n, int(opts.Limit))
		}
		list := &corev1.SecretList{Items: all[from : from+n]}
		if from+n < len(all) {
			list.Continue = base64.StdEncoding.EncodeToString([]byte(strconv.Itoa(from + n)))
		}
		*fetched += n
		return true, list, nil
	})
	return fetched, asked
}

func TestListLeasesHoldsNoMoreThanOnePage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	var want []string
	for _, ns := range []string{"argo", "argo", "argo", "argo", "argo", "argo", "argo", "flux", "flux", "flux", "flux", "flux"} {
		resp, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: ns, ServiceAccount: "reader"})
		require.NoError(t, err)
		want = append(want, resp.LeaseID)
	}
	// A lease under west's label held by another identity (a renamed
	// peer): counted by the API server's limit, never shown.
	list, err := e.client.CoreV1().Secrets("argo").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	foreign := list.Items[0].DeepCopy()
	foreign.Name, foreign.ResourceVersion, foreign.UID = foreign.Name+"-foreign", "", "foreign"
	foreign.Labels[objects.LabelLeaseID] = strings.Repeat("z", 26)
	foreign.Annotations[objects.AnnotationIdentity] = "spiffe://oc.example/cluster/old-west"
	_, err = e.client.CoreV1().Secrets("argo").Create(ctx, foreign, metav1.CreateOptions{})
	require.NoError(t, err)

	for _, tc := range []struct {
		name             string
		limit, maxAnswer int
	}{
		{"Pages of 3 the API server answers whole.", 3, 1000},
		{"Pages of 5 the API server answers 2 at a time.", 5, 2},
		{"One page of the largest size.", lease.MaxLeasePageSize, 1000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			// A broker of its own over a clientset of its own, with the
			// same Secrets.
			client := fake.NewClientset()
			for _, ns := range []string{"argo", "flux"} {
				l, err := e.client.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
				require.NoError(t, err)
				for i := range l.Items {
					require.NoError(t, client.Tracker().Add(&l.Items[i]))
				}
			}
			b, err := New(Config{Secrets: client.CoreV1(), Issuers: map[string]Issuer{apiv1.CredentialToken: &fakeIssuer{}},
				Policy: policy.NewStore(mustPolicy(t, testPolicy)), Logger: zap.NewNop()})
			require.NoError(t, err)
			fetched, asked := apiServerPaging(t, client, tc.maxAnswer)

			var got []string
			req := lease.PageRequest{Limit: tc.limit}
			for pages := 0; ; pages++ {
				require.Less(t, pages, 20, "the walk ends")
				*fetched, *asked = 0, nil
				page, err := b.ListLeases(ctx, west, req)
				require.NoError(t, err)
				require.LessOrEqual(t, *fetched, tc.limit, "Secrets read from the API server for one page")
				for _, l := range *asked {
					require.True(t, l > 0 && l <= int64(tc.limit), "each API list asks for at most the room left in the page, not %d", l)
				}
				for _, l := range page.Items {
					got = append(got, l.ID)
				}
				if page.Continue == "" {
					break
				}
				req.Continue = page.Continue
			}
			slices.Sort(got)
			sorted := slices.Sorted(slices.Values(want))
			require.Equal(t, sorted, got, "every lease of the caller once, no other")
		})
	}
}
