package broker

import (
	"context"
	"encoding/base64"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// allLeases walks every page of the caller's leases.
func allLeases(ctx context.Context, b *Broker, c Caller) ([]apiv1.Lease, error) {
	var out []apiv1.Lease
	req := LeasePageRequest{}
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

func TestLeaseContinueTokensRoundTrip(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cur  leaseCursor
	}{
		{"A namespace's beginning has no API token.", leaseCursor{Namespace: "argo"}},
		{"The API server's token is kept as it is, in either base64 alphabet.", leaseCursor{Namespace: "flux-system", APIContinue: "eyJ2IjoibWV0YS5rOHMuaW8vdjEiLCJydiI6MTIzfQ=="}},
		{"A URL-safe API token survives too.", leaseCursor{Namespace: "a", APIContinue: "ab-_cd+/"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			token := encodeLeaseContinue(tc.cur)
			require.NotContains(t, token, tc.cur.Namespace, "opaque: the namespace is not readable in it")
			got, err := decodeLeaseContinue(token)
			require.NoError(t, err)
			require.Equal(t, tc.cur, got)
		})
	}
}

func TestLeaseContinueTokensThatAreNotOursAreRefused(t *testing.T) {
	t.Parallel()
	enc := func(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
	for name, token := range map[string]string{
		"An empty token.":                          "",
		"Not base64url.":                           "a b c",
		"Padded base64 (not the canonical form).":  base64.URLEncoding.EncodeToString([]byte("l1\nargo\n")),
		"Another version.":                         enc("l2\nargo\n"),
		"Too few parts.":                           enc("l1\nargo"),
		"Too many parts.":                          enc("l1\nargo\nx\ny"),
		"A namespace that is no DNS label.":        enc("l1\nArgo\n"),
		"A path as the namespace.":                 enc("l1\n../kube-system\n"),
		"An empty namespace.":                      enc("l1\n\n"),
		"An API token with other characters.":      enc("l1\nargo\n{\"rv\":1}"),
		"An API token with a NUL.":                 enc("l1\nargo\nab\x00"),
		"A token over the size bound.":             enc("l1\nargo\n" + strings.Repeat("a", MaxLeaseContinueBytes)),
		"Non-canonical trailing bits of base64url": enc("l1\nargo\nab")[:len(enc("l1\nargo\nab"))-1] + "B",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := decodeLeaseContinue(token)
			require.ErrorIs(t, err, errBadContinue)
		})
	}
}

func TestListLeasesRefusesABadPageRequestWithoutAskingTheAPIServer(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		req   LeasePageRequest
		field string
	}{
		{"A negative limit (what the server passes for an unparsable one) is refused.", LeasePageRequest{Limit: -1}, "limit"},
		{"A limit over the maximum is refused.", LeasePageRequest{Limit: MaxLeasePageSize + 1}, "limit"},
		{"A continue token that is not ours is refused.", LeasePageRequest{Continue: "bm9wZQ"}, "continue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			_, err := e.b.ListLeases(context.Background(), west, tc.req)
			require.Equal(t, KindInvalid, KindOf(err))
			var be *Error
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

	first, err := e.b.ListLeases(ctx, west, LeasePageRequest{Limit: 1})
	require.NoError(t, err)
	require.Len(t, first.Items, 1)
	require.Equal(t, inArgo.LeaseID, first.Items[0].ID)
	require.NotEmpty(t, first.Continue, "flux is still to come")
	require.Len(t, e.client.Actions(), 1, "one namespace listed for a full page")

	second, err := e.b.ListLeases(ctx, west, LeasePageRequest{Limit: 1, Continue: first.Continue})
	require.NoError(t, err)
	require.Len(t, second.Items, 1)
	require.Equal(t, inFlux.LeaseID, second.Items[0].ID)
	require.Empty(t, second.Continue, "the last page")
	require.Equal(t, "flux", e.client.Actions()[1].GetNamespace())

	t.Run("A token whose namespace left the peer's grants resumes at the next namespace.", func(t *testing.T) {
		page, err := e.b.ListLeases(ctx, west, LeasePageRequest{Continue: encodeLeaseContinue(leaseCursor{Namespace: "b-gone", APIContinue: "abc"})})
		require.NoError(t, err)
		require.Len(t, page.Items, 1)
		require.Equal(t, inFlux.LeaseID, page.Items[0].ID)
		require.Empty(t, page.Continue)
	})

	t.Run("A token past the peer's last namespace gives an empty last page.", func(t *testing.T) {
		page, err := e.b.ListLeases(ctx, west, LeasePageRequest{Continue: encodeLeaseContinue(leaseCursor{Namespace: "zzz"})})
		require.NoError(t, err)
		require.Empty(t, page.Items)
		require.NotNil(t, page.Items, "items is [] on the wire, never null")
		require.Empty(t, page.Continue)
	})
}

func FuzzDecodeLeaseContinue(f *testing.F) {
	f.Add(encodeLeaseContinue(leaseCursor{Namespace: "argo"}))
	f.Add(encodeLeaseContinue(leaseCursor{Namespace: "argo", APIContinue: "eyJ2IjoibWV0YS5rOHMuaW8vdjEifQ=="}))
	f.Add("")
	f.Add("bDEKYXJnbwo")
	f.Fuzz(func(t *testing.T, token string) {
		cur, err := decodeLeaseContinue(token)
		if err != nil {
			require.ErrorIs(t, err, errBadContinue)
			return
		}
		// Whatever is accepted is canonical and within bounds.
		require.Equal(t, token, encodeLeaseContinue(cur))
		require.LessOrEqual(t, len(token), MaxLeaseContinueBytes)
		require.NotContains(t, cur.Namespace, "/")
		require.NotContains(t, cur.APIContinue, "\n")
	})
}
